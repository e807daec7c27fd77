"""The torch-free TensorRT engine's own code (buffers per output, typed outputs, a batch past
the profile's largest run in slices and put back together output by output), run against a
stand-in ``tensorrt`` module and a stand-in CUDA runtime that keeps "device" buffers in host
memory. The stand-in's execution context runs the same ONNX file in ONNX Runtime, so the
engine must answer exactly what the ONNX engine answers. TensorRT itself is not on the test
hosts (``test_engines.py`` has the real-engine test that runs where it is)."""

from __future__ import annotations

import ctypes
import json
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnxruntime as ort
import pytest

from agent.runtime import tensorrt_engine
from agent.runtime.engine_outputs import TensorSpec
from agent.runtime.engines import OnnxEngine, engine_for
from agent.runtime.tensorrt_engine import TensorRTEngine
from tests.agent.runtime import detector_onnx
from tests.agent.runtime.conftest import tiny_onnx

MAX_BATCH = 2


class FakeCuda:
    """cudaMalloc & co. over host memory; every copy checked against its buffer's size."""

    allocated: ClassVar[dict[int, ctypes.Array[ctypes.c_char]]] = {}
    """Every live buffer, of every instance: the stand-in context checks its writes here."""

    def malloc(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        self.allocated[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, ptr: int) -> None:
        del self.allocated[ptr]

    def stream(self) -> int:
        return 7

    def destroy_stream(self, stream: int) -> None:
        assert stream == 7

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        device = dst if kind == tensorrt_engine.H2D else src
        assert nbytes <= len(self.allocated[device]), "copy past a device buffer's end"
        ctypes.memmove(dst, src, nbytes)

    def sync(self, stream: int) -> None:
        pass


class FakeContext:
    """An execution context whose ``execute_async_v3`` runs the ONNX file in ONNX Runtime,
    reading and writing the addresses it was given."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.shape, self.addresses = engine, (0,), {}  # type: ignore[var-annotated]

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        assert name == self.engine.input_name and shape[0] <= MAX_BATCH
        self.shape = tuple(shape)

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (self.shape[0], *self.engine.shapes[name][1:])

    def set_tensor_address(self, name: str, ptr: int) -> None:
        self.addresses[name] = ptr

    def execute_async_v3(self, stream: int) -> bool:
        n = int(np.prod(self.shape))
        x = np.frombuffer((ctypes.c_float * n).from_address(self.addresses[
            self.engine.input_name]), np.float32).reshape(self.shape).copy()
        for name, arr in zip(self.engine.output_names, self.engine.session.run(
                self.engine.output_names, {self.engine.input_name: x}), strict=True):
            arr = np.ascontiguousarray(arr)
            assert arr.nbytes <= len(FakeCuda.allocated[self.addresses[name]])
            ctypes.memmove(self.addresses[name], arr.ctypes.data, arr.nbytes)
        return True


class FakeEngine:
    def __init__(self, onnx_path: Path) -> None:
        self.session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.names = [self.input_name, *self.output_names]
        self.num_io_tensors = len(self.names)
        self.shapes = {a.name: tuple(a.shape) for a in
                       (*self.session.get_inputs(), *self.session.get_outputs())}
        self.dtypes = {o.name: "INT32" if o.type == "tensor(int32)" else "FLOAT"
                       for o in self.session.get_outputs()}

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name == self.input_name else "OUTPUT"

    def get_tensor_dtype(self, name: str) -> str:
        return self.dtypes.get(name, "FLOAT")

    def create_execution_context(self) -> FakeContext:
        return FakeContext(self)


def fake_tensorrt(monkeypatch: pytest.MonkeyPatch, onnx_path: Path) -> None:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.3.0"  # type: ignore[attr-defined]
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})  # type: ignore[attr-defined]
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")  # type: ignore[attr-defined]
    trt.nptype = {"FLOAT": np.float32, "INT32": np.int32}.__getitem__  # type: ignore[attr-defined]

    class Runtime:
        def __init__(self, logger: Any) -> None:
            pass

        def deserialize_cuda_engine(self, plan: bytes) -> FakeEngine:
            assert plan == b"serialized plan"
            return FakeEngine(onnx_path)

    trt.Runtime = Runtime  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(tensorrt_engine, "CudaRuntime", FakeCuda)


def engine_slot(root: Path, onnx_path: Path, input_shape: tuple[int, ...]) -> Path:
    art = root / "slot" / "artefacts"
    art.mkdir(parents=True)
    (art / "model.engine").write_bytes(b"serialized plan")
    (art / "model.engine.json").write_text(json.dumps({
        "tensorrt_version": "10.3.0", "input_name": "input", "input_shape": list(input_shape),
        "profile": {"min": 1, "opt": 1, "max": MAX_BATCH}}))
    return root / "slot"


@pytest.mark.parametrize("model", ["classifier", "detector"])
def test_the_tensorrt_engine_answers_every_output_as_onnx_runtime_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    if model == "classifier":
        onnx_path, sample = tiny_onnx(tmp_path / "m.onnx", 3), (1, 8, 8)
        specs = (TensorSpec("logits", "FP32", (-1, 10)),)
    else:
        onnx_path = detector_onnx.tiny_detector_onnx(tmp_path / "m.onnx", 3)
        sample = detector_onnx.INPUT_SHAPE
        specs = tuple(TensorSpec(n, detector_onnx.DATATYPES[n],
                                 tuple(detector_onnx.SHAPES[n]))
                      for n in detector_onnx.OUTPUTS)
    fake_tensorrt(monkeypatch, onnx_path)
    engine = engine_for(engine_slot(tmp_path, onnx_path, sample))
    assert isinstance(engine, TensorRTEngine) and engine.platform == "tensorrt_plan"
    assert engine.outputs == specs and engine.input_shape == (-1, *sample)
    assert (engine.output_name, engine.output_shape) == (specs[0].name, specs[0].shape)
    x = np.random.default_rng(0).random((5, *sample), dtype=np.float32)  # 2 + 2 + 1
    got, want = engine(x), OnnxEngine(onnx_path)(x)
    assert list(got) == list(want) == [s.name for s in specs]
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name])
    engine.close()
    assert FakeCuda.allocated == {}  # the input's and every output's buffer freed
