"""A serialized TensorRT engine served without torch: device buffers from the CUDA runtime
through ctypes.

``exporters.tensorrt_build.TensorRTRunner`` holds its buffers as torch CUDA tensors, which is
fine in an export job and not in the serving process an application imports (torch adds
hundreds of MB and seconds of start-up to a process that never trains). The CUDA runtime
library ships with JetPack and with every TensorRT install, so six of its calls through
ctypes are all the engine needs. The engine's buffers are sized once for the optimization
profile's largest batch (``model.engine.json``: ``profile.max``); a larger request is run in
slices of that size, each output put back together along the batch. Every output (a
classifier's logits; a detector's num_detections, boxes, scores, classes) has its own buffer
and the numpy type TensorRT declares for it. An execution context is not thread-safe: calls
are serialized.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from agent.runtime.engine_outputs import EngineOutputs, TensorSpec, numpy_datatype

CUDART_NAMES = ("libcudart.so", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so.10.2")
H2D, D2H = 1, 2
"""cudaMemcpyKind: cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost."""


class CudaRuntime:
    """cudaMalloc/Free, a stream, async copies and a stream sync."""

    def __init__(self) -> None:
        errors = []
        for name in CUDART_NAMES:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise RuntimeError(f"no CUDA runtime library ({'; '.join(errors[:2])})")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"CUDA {what} failed with error {rc}")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "malloc")
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self.lib.cudaFree(ctypes.c_void_p(ptr))

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreate(ctypes.byref(s)), "stream create")
        return int(s.value or 0)

    def destroy_stream(self, stream: int) -> None:
        self.lib.cudaStreamDestroy(ctypes.c_void_p(stream))

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._check(self.lib.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                             ctypes.c_size_t(nbytes), ctypes.c_int(kind),
                                             ctypes.c_void_p(stream)), "memcpy")

    def sync(self, stream: int) -> None:
        self._check(self.lib.cudaStreamSynchronize(ctypes.c_void_p(stream)), "stream sync")


class TensorRTEngine:
    """``model.engine`` with the metadata ``exporters.tensorrt_build`` wrote beside it."""

    name = "tensorrt"
    platform = "tensorrt_plan"

    def __init__(self, path: Path, meta: dict[str, Any], trt: ModuleType) -> None:
        self.notes: tuple[str, ...] = ()
        self.providers = (f"TensorRT {trt.__version__}",)
        self._cuda = CudaRuntime()
        self._lock = threading.Lock()
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if self._engine is None:
            raise RuntimeError(f"{path}: TensorRT could not deserialize the engine")
        self._context = self._engine.create_execution_context()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.input_name = inputs[0]
        sample = tuple(int(d) for d in meta["input_shape"])
        self.max_batch = int(meta.get("profile", {}).get("max", 1))
        self._context.set_input_shape(self.input_name, (self.max_batch, *sample))
        self.input_shape = (-1, *sample)
        specs: list[TensorSpec] = []
        self._dtypes: dict[str, np.dtype[Any]] = {}
        out_bytes: dict[str, int] = {}
        for name in (n for n in names if n not in inputs):  # the engine's order: the model's
            dtype = np.dtype(trt.nptype(self._engine.get_tensor_dtype(name)))
            at_max = tuple(int(d) for d in self._context.get_tensor_shape(name))
            specs.append(TensorSpec(name, numpy_datatype(dtype, name), (-1, *at_max[1:])))
            self._dtypes[name], out_bytes[name] = dtype, dtype.itemsize * int(np.prod(at_max))
        self.outputs = tuple(specs)
        self.output_name, self.output_shape = self.outputs[0].name, self.outputs[0].shape
        self._in_bytes = 4 * self.max_batch * int(np.prod(sample))
        self._stream = self._cuda.stream()
        self._d_in = self._cuda.malloc(self._in_bytes)
        # One device buffer per output, each sized for the profile's largest batch.
        self._d_out = {name: self._cuda.malloc(n) for name, n in out_bytes.items()}

    def _run(self, x: np.ndarray) -> EngineOutputs:
        x = np.ascontiguousarray(x, dtype=np.float32)
        ctx, cuda = self._context, self._cuda
        ctx.set_input_shape(self.input_name, tuple(x.shape))
        out = EngineOutputs((name, np.empty(tuple(ctx.get_tensor_shape(name)), dtype=dtype))
                            for name, dtype in self._dtypes.items())
        cuda.copy(self._d_in, x.ctypes.data, x.nbytes, H2D, self._stream)
        ctx.set_tensor_address(self.input_name, self._d_in)
        for name, ptr in self._d_out.items():
            ctx.set_tensor_address(name, ptr)
        if not ctx.execute_async_v3(self._stream):
            raise RuntimeError("TensorRT execution failed")
        for name, arr in out.items():
            cuda.copy(arr.ctypes.data, self._d_out[name], arr.nbytes, D2H, self._stream)
        cuda.sync(self._stream)
        return out

    def __call__(self, x: np.ndarray) -> EngineOutputs:
        with self._lock:
            if len(x) <= self.max_batch:
                return self._run(x)
            return EngineOutputs.concat([self._run(x[i:i + self.max_batch])
                                         for i in range(0, len(x), self.max_batch)])

    def close(self) -> None:
        with self._lock:
            for ptr in (self._d_in, *self._d_out.values()):
                self._cuda.free(ptr)
            self._cuda.destroy_stream(self._stream)
            self._context = self._engine = None
