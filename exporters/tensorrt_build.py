"""TensorRT engines from the Q/DQ ONNX file, with the TensorRT Python API.

Explicit quantization: the engine takes its INT8 scales from the Q/DQ nodes (the implicit
calibrator classes are deprecated since TensorRT 10.1 and gone in 11), FP16 is allowed for
the layers left in float, ``SPARSE_WEIGHTS`` lets TensorRT pick sparse tensor-core kernels
for 2:4 weights (Ampere / Orin), the workspace is capped from the device profile and the
timing cache is kept between builds (a rebuild on the same device then takes seconds).

Only where ``tensorrt`` imports (a Jetson, or a GPU host with TensorRT); everywhere else the
functions here raise :class:`TensorRTUnavailable`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from exporters.detection.outputs import OUTPUT_NAMES, pack
from exporters.jetpack import l4t_release
from exporters.job import Precision, TensorRTConfig
from registry.atomic import atomic_output, write_json_atomic


class TensorRTUnavailable(RuntimeError):
    """TensorRT (or a CUDA device) is not available on this machine."""


def require_tensorrt() -> ModuleType:
    try:
        import tensorrt
    except ImportError as e:
        raise TensorRTUnavailable(
            "target=tensorrt needs the TensorRT Python package, which is not installed here: "
            "run on a Jetson (JetPack ships it) or a GPU host with `pip install tensorrt`, or "
            f"use target=onnxruntime ({e})"
        ) from e
    return tensorrt


@dataclass
class EngineInfo:
    path: Path
    metadata_path: Path
    tensorrt_version: str
    device: str
    precision: Precision
    sparse_weights: bool
    workspace_mb: int
    build_seconds: float
    size_bytes: int


def _device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    except Exception:  # the name is informative only; never fail a build over it
        pass
    return "unknown"


def _set_flag(trt: ModuleType, config: Any, name: str) -> bool:
    flag = getattr(trt.BuilderFlag, name, None)
    if flag is None:
        return False
    config.set_flag(flag)
    return True


def build_engine(
    onnx_path: Path,
    engine_path: Path,
    *,
    precision: Precision,
    sparse_weights: bool,
    input_shape: tuple[int, ...],
    cfg: TensorRTConfig,
) -> EngineInfo:
    """Parse ``onnx_path``, build and serialize an engine to ``engine_path`` plus metadata
    JSON beside it (``<engine>.json``)."""
    trt = require_tensorrt()
    t0 = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    # The parser finds plugin nodes (a detector's EfficientNMS_TRT) only once they are registered.
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 10:  # explicit batch became the only mode in 10
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace_mb << 20)
    if precision == "int8":
        _set_flag(trt, config, "INT8")
    if precision == "fp16" or (precision == "int8" and cfg.fp16):
        _set_flag(trt, config, "FP16")
    if sparse_weights:
        _set_flag(trt, config, "SPARSE_WEIGHTS")
    cache_path = cfg.timing_cache or engine_path.parent / "tensorrt.timing_cache"
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    inp = network.get_input(0)
    profile = builder.create_optimization_profile()
    opt = cfg.opt_batch or cfg.max_batch
    profile.set_shape(
        inp.name, (1, *input_shape), (opt, *input_shape), (cfg.max_batch, *input_shape)
    )
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see its log)")
    with atomic_output(engine_path) as tmp:
        tmp.write_bytes(bytes(serialized))
    with atomic_output(cache_path) as tmp:
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
    info = EngineInfo(
        path=engine_path,
        metadata_path=engine_path.with_name(engine_path.name + ".json"),
        tensorrt_version=str(trt.__version__),
        device=_device_name(),
        precision=precision,
        sparse_weights=sparse_weights,
        workspace_mb=cfg.workspace_mb,
        build_seconds=time.perf_counter() - t0,
        size_bytes=engine_path.stat().st_size,
    )
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(info).items()}
    meta.update(
        onnx=str(onnx_path),
        onnx_sha256=hashlib.sha256(Path(onnx_path).read_bytes()).hexdigest(),
        input_name=inp.name,
        input_shape=list(input_shape),
        profile={"min": 1, "opt": opt, "max": cfg.max_batch},
        # The JetPack it was built on (None off a Jetson): the runtime rebuilds an engine
        # after a JetPack upgrade, whose CUDA driver may not load it, instead of trying it.
        l4t=l4t_release(),
    )
    write_json_atomic(info.metadata_path, meta)
    return info


class TensorRTRunner:
    """Runs a serialized engine on the GPU; buffers are torch CUDA tensors (TensorRT 10 API).

    Latency measured through it includes the host<->device copies of input and logits.
    """

    def __init__(self, engine_path: Path, name: str = "tensorrt") -> None:
        trt = require_tensorrt()
        import torch

        if not torch.cuda.is_available():
            raise TensorRTUnavailable("running a TensorRT engine needs a CUDA device")
        self._torch = torch
        self.name = name
        logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(logger, "")  # a detector's engine holds EfficientNMS_TRT
        self.runtime = trt.Runtime(logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{engine_path}: TensorRT could not deserialize the engine")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.input_name = inputs[0]
        self.output_names = [n for n in names if n not in inputs]
        self.output_name = self.output_names[0]
        # A detector's engine (EfficientNMS_TRT): its four outputs, packed as ONNX Runtime's
        # runner packs them (exporters.detection.outputs).
        self.detections = set(OUTPUT_NAMES) <= set(self.output_names)
        self._int32 = {n for n in self.output_names
                       if self.engine.get_tensor_dtype(n) == trt.DataType.INT32}

    def __call__(self, x: np.ndarray) -> np.ndarray:
        torch = self._torch
        xt = torch.from_numpy(np.ascontiguousarray(x)).cuda()
        self.context.set_input_shape(self.input_name, tuple(xt.shape))
        self.context.set_tensor_address(self.input_name, xt.data_ptr())
        outs = {}
        for name in self.output_names if self.detections else [self.output_name]:
            outs[name] = torch.empty(
                tuple(self.context.get_tensor_shape(name)),
                dtype=torch.int32 if name in self._int32 else torch.float32,
                device="cuda",
            )
            self.context.set_tensor_address(name, outs[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        if self.detections:
            return pack([outs[n].cpu().numpy() for n in OUTPUT_NAMES])
        return outs[self.output_name].cpu().numpy()
