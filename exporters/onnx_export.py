"""PyTorch -> ONNX: opset >= 17, dynamic batch axis, checked, optionally simplified.

The file is self-contained (no external-data side file: a model that fits in 2 GB travels
as one file) and stripped of the exporter's per-node debug metadata (source stack traces),
which otherwise makes up a fifth of a small model's file and skews the size gate.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from torch import nn

from exporters.job import OnnxExportConfig
from registry.atomic import atomic_output

INPUT_NAME = "input"
OUTPUT_NAME = "logits"


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


def _torch_export(
    model: nn.Module, example: torch.Tensor, path: Path, cfg: OnnxExportConfig,
    output_name: str,
) -> None:
    common = {"input_names": [INPUT_NAME], "output_names": [output_name]}
    with _quiet_exporter(), torch.no_grad():
        if cfg.exporter == "dynamo":
            dynamic = ({0: torch.export.Dim("batch")},) if cfg.dynamic_batch else None
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
