"""engine_for: a TensorRT engine only where tensorrt imports and the engine's recorded
TensorRT version is the installed one, else the ONNX file with the best ONNX Runtime provider,
each fallback said. TensorRT is not on the test hosts: a stand-in module plays it."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from agent.runtime import engines, tensorrt_engine
from agent.runtime.engine_outputs import TensorSpec
from agent.runtime.engines import NoServableArtefactError, OnnxEngine, engine_for, onnx_providers
from agent.runtime.trt_cache import (
    CACHE_DIR,
    engine_cache_dir,
    engine_platform,
    onnx_digest,
    with_engine_cache,
)
from tests.agent.runtime.conftest import INPUT_SHAPE, served_version, tiny_onnx


def make_slot(root: Path, *, onnx: bool = True, engine_version: str | None = None,
              l4t: str | None = None) -> Path:
    art = root / "slot" / "artefacts"
    art.mkdir(parents=True)
    if onnx:
        tiny_onnx(art / "model.onnx", 4)
    if engine_version is not None:
        (art / "model.engine").write_bytes(b"serialized plan")
        (art / "model.engine.json").write_text(json.dumps({
            "tensorrt_version": engine_version, "input_name": "input", "input_shape": [1, 8, 8],
            "profile": {"min": 1, "opt": 8, "max": 32},
            **({"l4t": l4t} if l4t else {})}))
    return root / "slot"


def fake_tensorrt(monkeypatch: pytest.MonkeyPatch, version: str) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return trt


class FakeTensorRTEngine:
    name, platform = "tensorrt", "tensorrt_plan"

    def __init__(self, path: Path, meta: dict[str, Any], trt: Any) -> None:
        self.path, self.meta, self.providers = path, meta, (f"TensorRT {trt.__version__}",)
        self.notes = ()


def test_the_onnx_file_serves_where_there_is_no_engine(tmp_path: Path) -> None:
    engine = engine_for(make_slot(tmp_path))
    assert isinstance(engine, OnnxEngine) and engine.platform == "onnxruntime_onnx"
    assert (engine.input_name, engine.input_shape) == ("input", (-1, 1, 8, 8))
    assert (engine.output_name, engine.output_shape) == ("logits", (-1, 10))
    assert engine.outputs == (TensorSpec("logits", "FP32", (-1, 10)),)
    assert engine.providers[-1] == "CPUExecutionProvider"
    out = engine(np.zeros((3, 1, 8, 8), np.float32))
    assert list(out) == ["logits"] and served_version(out["logits"]) == 4
    assert served_version(np.asarray(out)) == 4  # a one-output model's reads as its array
    assert not any("model.engine" in n for n in engine.notes)


def test_an_engine_is_skipped_where_tensorrt_does_not_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    engine = engine_for(make_slot(tmp_path, engine_version="10.3.0"))
    assert engine.name == "onnxruntime"
    assert any("tensorrt package is not importable" in n for n in engine.notes), engine.notes


def test_an_engine_built_by_another_tensorrt_version_is_skipped_saying_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tensorrt(monkeypatch, "10.3.0")
    monkeypatch.setattr(tensorrt_engine, "TensorRTEngine", FakeTensorRTEngine)
    engine = engine_for(make_slot(tmp_path, engine_version="8.6.1"))
    assert engine.name == "onnxruntime"
    (note,) = [n for n in engine.notes if "model.engine" in n]
    assert "built with TensorRT 8.6.1, this host has 10.3.0" in note and "rebuild" in note


def test_an_engine_built_on_another_jetpack_is_skipped_saying_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tensorrt(monkeypatch, "10.3.0")
    monkeypatch.setattr(tensorrt_engine, "TensorRTEngine", FakeTensorRTEngine)
    monkeypatch.setattr(engines, "l4t_release", lambda: "R36.4.7")
    engine = engine_for(make_slot(tmp_path / "old", engine_version="10.3.0", l4t="R36.3.0"))
    assert engine.name == "onnxruntime"
    (note,) = [n for n in engine.notes if "model.engine" in n]
    assert "built on L4T R36.3.0, this device runs R36.4.7" in note and "rebuild" in note
    # Built here, or before engines recorded it: judged by the TensorRT version alone.
    for where, l4t in (("here", "R36.4.7"), ("unrecorded", None)):
        chosen = engine_for(make_slot(tmp_path / where, engine_version="10.3.0", l4t=l4t))
        assert isinstance(chosen, FakeTensorRTEngine), where


def test_an_engine_without_its_metadata_is_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tensorrt(monkeypatch, "10.3.0")
    slot = make_slot(tmp_path, engine_version="10.3.0")
    (slot / "artefacts/model.engine.json").unlink()
    engine = engine_for(slot)
    assert engine.name == "onnxruntime"
    assert any("TensorRT version it was built with is unknown" in n for n in engine.notes)


def test_a_matching_engine_is_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tensorrt(monkeypatch, "10.3.0")
    monkeypatch.setattr(tensorrt_engine, "TensorRTEngine", FakeTensorRTEngine)
    engine = engine_for(make_slot(tmp_path, engine_version="10.3.0"))
    assert isinstance(engine, FakeTensorRTEngine) and engine.platform == "tensorrt_plan"
    assert engine.meta["profile"]["max"] == 32 and engine.providers == ("TensorRT 10.3.0",)
    # An engine alone is enough: no ONNX file needed.
    assert isinstance(engine_for(make_slot(tmp_path / "2", onnx=False, engine_version="10.3.0")),
                      FakeTensorRTEngine)


def test_an_engine_that_fails_to_load_falls_back_to_onnx(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real loader against a stand-in tensorrt with no runtime (and, here, no CUDA).
    fake_tensorrt(monkeypatch, "10.3.0")
    engine = engine_for(make_slot(tmp_path, engine_version="10.3.0"))
    assert engine.name == "onnxruntime"
    assert any("TensorRT could not load it" in n for n in engine.notes), engine.notes


def test_a_slot_with_nothing_to_serve_says_what_it_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(NoServableArtefactError, match=r"no artefacts/model.onnx.*not importable"
                       r".*exported to ONNX"):
        engine_for(make_slot(tmp_path, onnx=False, engine_version="10.3.0"))


def test_providers_best_first_among_those_available() -> None:
    every = ["AzureExecutionProvider", "CPUExecutionProvider", "CUDAExecutionProvider",
             "TensorrtExecutionProvider"]
    assert onnx_providers(every) == ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                     "CPUExecutionProvider"]
    assert onnx_providers(["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert onnx_providers([]) == ["CPUExecutionProvider"]


def test_a_real_tensorrt_engine_matches_onnx_runtime(tmp_path: Path) -> None:
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed on this host "
                              "(JetPack or a GPU host with `pip install tensorrt` runs this)")
    from exporters.job import TensorRTConfig
    from exporters.tensorrt_build import build_engine

    slot = make_slot(tmp_path)
    art = slot / "artefacts"
    build_engine(art / "model.onnx", art / "model.engine", precision="fp32",
                 sparse_weights=False, input_shape=(1, 8, 8), cfg=TensorRTConfig(max_batch=8))
    engine = engine_for(slot)
    assert engine.name == "tensorrt" and engine.providers == (f"TensorRT {trt.__version__}",)
    x = np.random.default_rng(0).random((20, 1, 8, 8), dtype=np.float32)  # > max_batch: sliced
    want = OnnxEngine(art / "model.onnx")(x)
    got = engine(x)
    assert list(got) == list(want) == ["logits"]
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-3, atol=1e-3)
    engine.close()


@pytest.mark.filterwarnings("ignore:Specified provider .TensorrtExecutionProvider.")
def test_the_tensorrt_provider_gets_an_engine_cache_per_model_file_beside_the_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No TensorRT EP in this ONNX Runtime build: asked for, it is passed over with a warning
    # and the CPU serves, but the options it would have got are built and the cache laid out.
    asked: list[Any] = []
    real_session = ort.InferenceSession

    def spy(path: str, opts: Any, providers: Any) -> Any:
        asked.append(providers)
        return real_session(path, opts, providers=providers)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    models = tmp_path / "models" / "digits"
    slots = []
    for i in range(5):  # five versions: each its own ONNX file (logit 0 of a zero batch = 4 + i)
        slot = models / f"slot{i}" / "artefacts"
        slot.mkdir(parents=True)
        tiny_onnx(slot / "model.onnx", 4 + i)
        slots.append(slot.parent)
        engine = engine_for(slot.parent, ["TensorrtExecutionProvider", "CPUExecutionProvider"])
        assert engine.providers == ("CPUExecutionProvider",)
        assert engine(np.zeros((1, *INPUT_SHAPE), np.float32))["logits"][0, 0] == 4 + i
        time.sleep(0.01)  # distinct folder times
    trt, cpu = asked[-1]
    assert cpu == "CPUExecutionProvider" and trt[0] == "TensorrtExecutionProvider"
    cache_root = models / CACHE_DIR
    opts = trt[1]
    assert opts["trt_engine_cache_enable"] == "True" and opts["trt_timing_cache_enable"] == "True"
    assert Path(opts["trt_engine_cache_path"]).parent == cache_root
    assert opts["trt_timing_cache_path"] == str(cache_root)
    assert Path(opts["trt_engine_cache_path"]).name.startswith(onnx_digest(
        slots[-1] / "artefacts/model.onnx")[:32] + "-")
    assert json.loads((Path(opts["trt_engine_cache_path"]) / "platform.json").read_text()) \
        == engine_platform()
    # Bounded: the newest three versions' folders stay; the same file maps to the same folder.
    kept = sorted(d.name for d in cache_root.iterdir())
    assert [k.split("-")[0] for k in kept] == sorted(
        onnx_digest(s / "artefacts/model.onnx")[:32] for s in slots[-3:])
    engine_for(slots[-1], ["TensorrtExecutionProvider", "CPUExecutionProvider"])
    assert sorted(d.name for d in cache_root.iterdir()) == kept
    # Not asked for TensorRT: no options, no folder.
    assert with_engine_cache(["CPUExecutionProvider"], slots[0], Path("-")) == [
        "CPUExecutionProvider"]


@pytest.mark.filterwarnings("ignore:Specified provider .TensorrtExecutionProvider.")
def test_a_models_folder_it_cannot_write_serves_without_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = make_slot(tmp_path)

    def refuse(*_: Any, **__: Any) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path / CACHE_DIR))

    monkeypatch.setattr(Path, "mkdir", refuse)
    assert with_engine_cache(["TensorrtExecutionProvider", "CPUExecutionProvider"], slot,
                             slot / "artefacts/model.onnx") == [
        "TensorrtExecutionProvider", "CPUExecutionProvider"]
    engine = engine_for(slot, ["TensorrtExecutionProvider", "CPUExecutionProvider"])
    assert engine.providers == ("CPUExecutionProvider",)


def test_an_engine_of_another_platform_gets_its_own_folder(tmp_path: Path) -> None:
    """After a JetPack upgrade (another L4T, another TensorRT) the engine is built afresh, in
    a folder of its own that records what built it; the same platform finds its folder."""
    slot = make_slot(tmp_path)
    onnx = slot / "artefacts/model.onnx"
    jp60 = {"onnxruntime": "1.20.0", "tensorrt": "10.3.0", "l4t": "R36.3.0"}
    jp62 = {"onnxruntime": "1.20.0", "tensorrt": "10.3.0", "l4t": "R36.4.7"}
    a, b = engine_cache_dir(slot, onnx, jp60), engine_cache_dir(slot, onnx, jp62)
    assert a != b and a.parent == b.parent == slot.parent / CACHE_DIR
    assert json.loads((a / "platform.json").read_text()) == jp60
    assert json.loads((b / "platform.json").read_text()) == jp62
    assert engine_cache_dir(slot, onnx, dict(jp60)) == a
