"""What runs a slot's model: a TensorRT engine where one was built for this host, else the ONNX
file in ONNX Runtime with the best execution provider it has.

:func:`engine_for` is a plain function of the slot folder, with no daemon behind it: the
application's :class:`~agent.runtime.active_model.ActiveModel`, ``agentctl serve`` and the
device's health check pick the runtime the same way, so a served number is a gated number.

The choice, in order, each fallback said in :attr:`ServingEngine.notes`:

1. ``artefacts/model.engine`` when it is there, ``tensorrt`` imports, and the TensorRT version
   recorded beside the engine (``model.engine.json``, written by
   ``exporters.tensorrt_build``) is the one installed: a serialized engine only loads on the
   TensorRT version (and the GPU) that built it;
2. ``artefacts/model.onnx`` through :func:`exporters.ort_runner.ort_session` (the one way the
   project builds a session), providers TensorRT EP > CUDA EP > CPU as this ONNX Runtime
   build offers them; the TensorRT EP with its engine cache (``agent.runtime.trt_cache``).

Torch-free: the TensorRT engine's device buffers come from the CUDA runtime through ctypes
(``agent.runtime.tensorrt_engine``), not from torch as the exporter's runner has them.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np
import onnxruntime as ort

from agent.runtime.engine_outputs import EngineOutputs, TensorSpec, onnx_datatype
from agent.runtime.trt_cache import ProviderSpec, with_engine_cache
from exporters.jetpack import l4t_release
from exporters.ort_runner import ort_session

log = logging.getLogger("agent.runtime")

ARTEFACTS = "artefacts"
ONNX_FILE = "model.onnx"
ENGINE_FILE = "model.engine"
ENGINE_META = "model.engine.json"
PROVIDER_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
"""Best first: ONNX Runtime falls back per node to the next provider in the list."""
MAX_META_BYTES = 1 << 20


class NoServableArtefactError(RuntimeError):
    """The slot has neither a usable TensorRT engine nor an ONNX file."""


class ServingEngine(Protocol):
    """One loaded model: a float32 NCHW batch in, every output out by name (a classifier's
    one float32 logits; a detector's num_detections, boxes, scores and classes, typed as the
    model declares them). Safe to call from many threads at once (an engine that is not
    serializes its calls itself)."""

    name: str
    """onnxruntime | tensorrt"""
    platform: str
    """The Open Inference Protocol's platform name: onnxruntime_onnx | tensorrt_plan."""
    input_name: str
    input_shape: tuple[int, ...]
    """-1 where a dimension varies (the batch)."""
    outputs: tuple[TensorSpec, ...]
    """Every output: name, the protocol's datatype, shape (-1 where it varies), in the
    model's order."""
    output_name: str
    """The first output's name (a classifier's logits)."""
    output_shape: tuple[int, ...]
    """The first output's shape."""
    providers: tuple[str, ...]
    """What runs it: the ONNX Runtime providers in use, or ('TensorRT x.y',)."""
    notes: tuple[str, ...]
    """Why a better runtime was not chosen (empty when nothing was passed over)."""

    def __call__(self, x: np.ndarray) -> EngineOutputs:
        """Every output of ``x``'s run, in the model's order, each batch-first."""
        ...

    def close(self) -> None: ...


def onnx_providers(available: list[str] | None = None) -> list[str]:
    """The execution providers to ask for, best first, among those this ONNX Runtime build
    has (``ort.get_available_providers()``); CPU always comes last."""
    have = set(ort.get_available_providers() if available is None else available)
    return [p for p in PROVIDER_ORDER if p in have or p == "CPUExecutionProvider"]


def _dims(shape: list[object]) -> tuple[int, ...]:
    # A symbolic dimension ('batch', None) is a variable one: -1, as the protocol writes it.
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)


class OnnxEngine:
    """The slot's ONNX file in one ONNX Runtime session (``session.run`` is thread-safe)."""

    name = "onnxruntime"
    platform = "onnxruntime_onnx"

    def __init__(self, path: Path, *, providers: list[ProviderSpec] | None = None, threads: int = 0,
                 spin: bool = True, notes: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.session: ort.InferenceSession | None = ort_session(
            self.path, threads=threads, providers=providers or onnx_providers(), spin=spin)
        inp = self.session.get_inputs()[0]
        self.input_name, self.input_shape = inp.name, _dims(inp.shape)
        self.outputs = tuple(TensorSpec(o.name, onnx_datatype(o.type, o.name), _dims(o.shape))
                             for o in self.session.get_outputs())
        self.output_name, self.output_shape = self.outputs[0].name, self.outputs[0].shape
        self.providers = tuple(self.session.get_providers())
        self.notes = notes
        self._names = [o.name for o in self.outputs]

    def __call__(self, x: np.ndarray) -> EngineOutputs:
        assert self.session is not None, "closed"
        return EngineOutputs(zip(self._names, self.session.run(self._names, {self.input_name: x}),
                                 strict=True))

    def close(self) -> None:
        # ONNX Runtime frees a session's arena when the last reference goes.
        self.session = None


def _import_tensorrt() -> ModuleType:
    # Through importlib so a test can stand a module in for TensorRT in sys.modules.
    return importlib.import_module("tensorrt")


def _engine_meta(engine: Path) -> dict[str, object]:
    meta_path = engine.with_name(ENGINE_META)
    if not meta_path.is_file() or meta_path.stat().st_size > MAX_META_BYTES:
        raise ValueError(f"no {ENGINE_META} beside it: the TensorRT version it was built with "
                         "is unknown")
    doc = json.loads(meta_path.read_bytes())
    if not isinstance(doc, dict) or not isinstance(doc.get("tensorrt_version"), str):
        raise ValueError(f"{ENGINE_META} names no tensorrt_version")
    return doc


def _tensorrt_engine(engine: Path) -> tuple[ServingEngine | None, str | None]:
    """The engine, or None and why not."""
    try:
        trt = _import_tensorrt()
    except ImportError as e:
        return None, (f"{ENGINE_FILE} skipped: the tensorrt package is not importable here "
                      f"({e})")
    try:
        meta = _engine_meta(engine)
    except (OSError, ValueError) as e:
        return None, f"{ENGINE_FILE} skipped: {e}"
    built, here = str(meta["tensorrt_version"]), str(getattr(trt, "__version__", "?"))
    if built != here:
        return None, (f"{ENGINE_FILE} skipped: built with TensorRT {built}, this host has "
                      f"{here} (an engine loads only on the version that built it: rebuild "
                      "it on this device)")
    # Recorded since engines carry it; an older engine's metadata has no l4t and is judged by
    # its TensorRT version alone.
    built_l4t, here_l4t = meta.get("l4t"), l4t_release()
    if built_l4t is not None and built_l4t != here_l4t:
        return None, (f"{ENGINE_FILE} skipped: built on L4T {built_l4t}, this device runs "
                      f"{here_l4t or 'no L4T'} (a JetPack upgrade changes the CUDA driver "
                      "under it: rebuild it on this device)")
    from agent.runtime.tensorrt_engine import TensorRTEngine

    try:
        return TensorRTEngine(engine, meta, trt), None
    except Exception as e:  # a GPU-side failure must leave the ONNX path open, said why
        return None, f"{ENGINE_FILE} skipped: TensorRT could not load it ({e})"


def engine_for(slot_path: Path, providers: list[str] | None = None, *,
               threads: int = 0, spin: bool = True) -> ServingEngine:
    """The runtime for the version in ``slot_path`` (a slot folder, or any folder laid out
    like one): its TensorRT engine where usable, else its ONNX file in ONNX Runtime.
    ``providers`` overrides the ONNX Runtime provider choice; ``threads`` 0 = its default;
    ``spin=False``: its threads sleep between runs (``exporters.ort_runner.ort_session``)."""
    artefacts = Path(slot_path) / ARTEFACTS
    notes: list[str] = []
    engine = artefacts / ENGINE_FILE
    if engine.is_file():
        chosen, why = _tensorrt_engine(engine)
        if chosen is not None:
            return chosen
        assert why is not None
        notes.append(why)
        log.info("%s: %s", slot_path, why, extra={"fields": {"event": "engine_fallback"}})
    onnx = artefacts / ONNX_FILE
    if not onnx.is_file():
        raise NoServableArtefactError(
            f"{slot_path} has no {ARTEFACTS}/{ONNX_FILE} to serve"
            + (f" ({'; '.join(notes)})" if notes else "")
            + ": deploy a version exported to ONNX (a device fine-tune with steps.export, or "
            "an upstream version published with its model.onnx artefact)")
    wanted = providers or onnx_providers()
    if providers is None and wanted[0] != PROVIDER_ORDER[0]:
        notes.append(f"ONNX Runtime here offers {', '.join(ort.get_available_providers())}: "
                     f"running on {wanted[0]}")
    return OnnxEngine(onnx, providers=with_engine_cache(wanted, slot_path, onnx),
                      threads=threads, spin=spin, notes=tuple(notes))
