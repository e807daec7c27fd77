"""PyTorch -> ONNX: opset >= 17, dynamic batch axis, checked, optionally simplified.

The file is self-contained (no external-data side file: a model that fits in 2 GB travels
as one file) and stripped of the exporter's per-node debug metadata (source stack traces),
which otherwise makes up a fifth of a small model's file and skews the size gate.

The dynamo exporter's table of torchlib functions is listed without re-parsing their source
(:func:`list_torchlib_ops_without_parsing`, below): see its section. It traces the model with
its in-place clamp-like activations out of place (:func:`activations_out_of_place`): the same
graph, a third less time for a MobileNet or an SSDlite.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import pkgutil
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from exporters.job import OnnxExportConfig
from registry.atomic import atomic_output

INPUT_NAME = "input"
OUTPUT_NAME = "logits"

log = logging.getLogger("exporters.onnx_export")


@dataclass
class OnnxExport:
    path: Path
    opset: int
    input_name: str
    output_name: str
    simplified_by: str | None
    size_bytes: int


@dataclass
class Exported:
    onnx: OnnxExport
    """The whole graph (what FP32 serves)."""
    core: Path | None = None
    """The part INT8 quantizes, when it is not the whole graph."""
    tail: Path | None = None
    """The settings of the float tail appended after the core."""


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    # The exporter logs a warning per missing optional op library (torchvision) and emits
    # deprecation noise on every call; none of it concerns the exported graph.
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=UserWarning)
            yield
    finally:
        logger.setLevel(level)


def _same(a: Any, b: Any) -> bool:
    """Two forward results equal bit for bit (tensors, or lists, tuples and dicts of them)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


TRACED_THROUGH_PRIMS = (nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid)
"""In-place activations that torch.export traces through their reference implementations
(clamps, down to prims) where the out-of-place op is traced as itself (ReLU6 is a Hardtanh).
In-place ReLU is not among them: out of place, a ResNet's export took 7% longer."""


@contextlib.contextmanager
def activations_out_of_place(model: nn.Module, example: torch.Tensor) -> Iterator[None]:
    """The model's in-place Hardtanh (ReLU6), Hardswish and Hardsigmoid modules
    (:data:`TRACED_THROUGH_PRIMS`: the activations of MobileNetV2 and V3) run out of place
    while the dynamo exporter traces it; set back as they were after.

    Why: torch.export functionalizes such an in-place op by tracing its reference
    implementation (``torch._refs``) down to prims, and each prim checks its shapes on the
    symbolic batch through sympy, one dimension at a time. Out of place, an SSDlite core's
    export took 0.69x the CPU and a MobileNetV2's 0.64x (``python
    benchmarks/export_time.py``). The ONNX graph is the same node for node either way (the
    exporter lowers both forms to one ONNX op); only the generated names of its values differ.

    A model whose result depends on an in-place side effect (an activation's output dropped,
    the input it changed read instead) would lose it out of place: so one forward pass on a
    random batch shaped as ``example`` must agree bit for bit first, else nothing is changed.
    """
    # In train mode the check's forward passes would move BatchNorm's running statistics:
    # such a model (export_onnx sets eval mode first) is left as it is.
    flipped = [] if model.training else [
        m for m in model.modules() if isinstance(m, TRACED_THROUGH_PRIMS) and m.inplace is True]
    if flipped:
        x = torch.rand(example.shape, generator=torch.Generator().manual_seed(0))
        x = x.to(example.device, example.dtype)
        with torch.no_grad():
            before = model(x.clone())
            for m in flipped:
                m.inplace = False
            try:
                agree = _same(before, model(x.clone()))
            except Exception:  # out of place, it cannot even run: leave it be
                agree = False
        if not agree:
            for m in flipped:
                m.inplace = True
            log.info("in-place modules left in place for the export: out of place, the "
                     "model's output differs")
            flipped = []
    try:
        yield
    finally:
        for m in flipped:
            m.inplace = True


def _torch_export(
    model: nn.Module, example: torch.Tensor, path: Path, cfg: OnnxExportConfig,
    output_name: str,
) -> None:
    common = {"input_names": [INPUT_NAME], "output_names": [output_name]}
    with _quiet_exporter(), torch.no_grad():
        if cfg.exporter == "dynamo":
            list_torchlib_ops_without_parsing()  # ~500 functions' source not parsed per call
            dynamic = ({0: torch.export.Dim("batch")},) if cfg.dynamic_batch else None
            with activations_out_of_place(model, example):
                torch.onnx.export(
                    model, (example,), str(path), opset_version=cfg.opset, dynamo=True,
                    dynamic_shapes=dynamic, external_data=False, verbose=False, **common,
                )
        else:
            axes = {INPUT_NAME: {0: "batch"}, output_name: {0: "batch"}}
            torch.onnx.export(
                model, (example,), str(path), opset_version=cfg.opset, dynamo=False,
                dynamic_axes=axes if cfg.dynamic_batch else None, **common,
            )


def strip_debug_info(model: onnx.ModelProto) -> None:
    """Drop per-node metadata and doc strings (stack traces, module paths)."""
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    model.graph.doc_string = ""


def _simplify(model: onnx.ModelProto, how: str) -> tuple[onnx.ModelProto, str | None]:
    candidates = ["onnxslim", "onnxsim"] if how == "auto" else [how]
    for name in candidates:
        if importlib.util.find_spec(name) is None:
            if how != "auto":
                raise RuntimeError(f"onnx.simplify={how} but {name} is not installed: "
                                   f"pip install {name}, or set onnx.simplify=auto|off")
            continue
        if name == "onnxslim":
            import onnxslim

            return onnxslim.slim(model), name
        import onnxsim

        simplified, ok = onnxsim.simplify(model)
        if not ok:
            raise RuntimeError("onnxsim could not validate the simplified graph")
        return simplified, name
    return model, None


def opset_of(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    raise ValueError("the model imports no default-domain opset")


def export_onnx(
    model: nn.Module,
    path: Path,
    input_shape: tuple[int, ...],
    cfg: OnnxExportConfig | None = None,
    output_name: str = OUTPUT_NAME,
) -> OnnxExport:
    """Export ``model`` (in eval mode) for inputs ``(batch, *input_shape)`` to ``path``; its
    one output is named ``output_name``."""
    cfg = cfg or OnnxExportConfig()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # Batch 2, not 1: an example batch of 1 lets some exporters specialize the dimension.
    example = torch.zeros(2, *input_shape, device=device)
    try:
        with atomic_output(Path(path)) as tmp:
            _torch_export(model, example, tmp, cfg, output_name)
            proto = onnx.load(str(tmp))
            strip_debug_info(proto)
            simplified_by = None
            if cfg.simplify != "off":
                proto, simplified_by = _simplify(proto, cfg.simplify)
            proto.producer_name = "edgetrain.exporters"
            onnx.save(proto, str(tmp))
            # full_check also runs shape inference: catches a broken graph before any runtime.
            onnx.checker.check_model(str(tmp), full_check=True)
    finally:
        model.train(was_training)
    opset = opset_of(proto)
    if opset < 17:
        raise RuntimeError(f"exported opset {opset} < 17")
    return OnnxExport(
        path=Path(path),
        opset=opset,
        input_name=proto.graph.input[0].name,
        output_name=proto.graph.output[0].name,
        simplified_by=simplified_by,
        size_bytes=Path(path).stat().st_size,
    )


# --- the dynamo exporter's torchlib functions, listed without parsing their source -----
#
# ``torch.onnx.export(..., dynamo=True)`` builds its table of ATen -> ONNX functions afresh on
# every call, from onnxscript's ``get_torchlib_ops()`` (``onnxscript._framework_apis``). That
# lists each function with its domain, read as ``function.function_ir.domain``; for the ~500
# traced functions (``TracedOnnxFunction``) ``function_ir`` is not stored but rebuilt on every
# read: the function's source looked up and tokenized (``inspect.getsource``), parsed, its
# signature translated. The domain so built is always the function's opset's (onnxscript's
# converter names the IR after ``opset.domain``), which the op holds as ``.domain``.
#
# :func:`list_torchlib_ops_without_parsing` puts in its place a listing that reads ``.domain``:
# the same entries in the same order, and the same exported file byte for byte
# (``tests/exporters/test_onnx_export.py`` checks both against onnxscript's own). It still lists
# the registry afresh on each call, as onnxscript's does (a function registered later is listed
# too), in ~1 ms. On this project's 2-core x86 host each export of a small CNN costs ~0.3 CPU s
# less: 2.6 -> 2.3 s for a process's first (imports included), 0.75 -> 0.43 s for each later
# one; a fresh process that exports twice, 0.89-0.97x of its CPU over three runs (``python
# benchmarks/process_start.py``). Where onnxscript's layout is not the one this was written
# against, nothing is changed and the exporter lists its functions its own way.

_listing_lock = threading.Lock()
_listing_installed: bool | None = None
"""None: not tried yet; True: the listing is in place; False: onnxscript's layout differs."""


def _listing(registration: Any, meta: Callable[..., Any]) -> Callable[[], list[Any]]:
    """``get_torchlib_ops`` as onnxscript writes it, the domain read from the op."""

    def get_torchlib_ops() -> list[Any]:
        # Registers every torchlib function in registration.default_registry (what onnxscript's
        # own listing imports first, for the same reason).
        importlib.import_module("onnxscript.function_libs.torch_lib.ops")
        listed: list[Any] = []
        for name, funcs in registration.default_registry.items():
            if name.startswith("internal::"):  # onnxscript's own helpers
                continue
            listed.extend(meta(qualified_name=name, function=f, domain=f.domain, name=f.name,
                               is_complex=False) for f in funcs.overloads)
            listed.extend(meta(qualified_name=name, function=f, domain=f.domain, name=f.name,
                               is_complex=True) for f in funcs.complex)
        return listed

    return get_torchlib_ops


def onnxscript_listing() -> Callable[[], list[Any]] | None:
    """onnxscript's own ``get_torchlib_ops`` (None where its layout differs)."""
    try:
        base = importlib.import_module("onnxscript._framework_apis.torch_2_5")
    except ImportError:
        return None
    found = getattr(base, "get_torchlib_ops", None)
    return getattr(found, "__wrapped_listing__", found)


def list_torchlib_ops_without_parsing() -> bool:
    """Put the listing that reads each op's domain in place of onnxscript's, in every one of its
    ``_framework_apis`` modules that binds it (each torch release imports its own). Idempotent;
    False where onnxscript's layout differs (then nothing is changed)."""
    global _listing_installed
    if _listing_installed is not None:
        return _listing_installed
    with _listing_lock:
        if _listing_installed is None:
            _listing_installed = _install_listing()
    return _listing_installed


def _install_listing() -> bool:
    try:
        apis = importlib.import_module("onnxscript._framework_apis")
        base = importlib.import_module("onnxscript._framework_apis.torch_2_5")
        registration = importlib.import_module("onnxscript.function_libs.torch_lib.registration")
        original, meta = base.get_torchlib_ops, base._OnnxFunctionMeta
        registration.default_registry.items  # noqa: B018 - the attribute the listing reads
    except (ImportError, AttributeError) as e:
        log.debug("onnxscript's torchlib listing left as it is: %s", e)
        return False
    listing = _listing(registration, meta)
    listing.__wrapped_listing__ = original  # type: ignore[attr-defined]
    for info in pkgutil.iter_modules(apis.__path__):
        try:
            module = importlib.import_module(f"{apis.__name__}.{info.name}")
        except ImportError:  # a module for another torch release, with imports this one lacks
            continue
        if getattr(module, "get_torchlib_ops", None) is original:
            module.get_torchlib_ops = listing
    return True
