"""How the torch half of an export reads each task's model: what its held-out targets, its
reference outputs and its exported ONNX graph are. One form per exported task
(``exporters.job.EXPORTED_TASKS``), chosen by :func:`form_of`; ``exporters.prepare`` calls
them and never asks which task it holds.

- classification: logits ``[N, C]`` are the outputs, integer labels the targets, the ONNX
  file the whole network;
- detection: the outputs are the padded detections of ``exporters.detection_outputs``
  (packed one array per batch), the targets packed ground-truth rows, the ONNX file the
  network's core (``exporters.detector_core``) with decoding and NMS appended
  (``exporters.detection_tail``); the core alone is what INT8 quantizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from exporters.detection_outputs import HEAD_NAME, pack_detections, pack_targets
from exporters.job import OnnxExportConfig
from exporters.onnx_export import OnnxExport, export_onnx
from exporters.runtime import TorchRunner, predict
from hpc_core.data import held_out

CORE_FILE = "core.fp32.onnx"
"""A detector's quantizable core, in the export's work folder."""
TAIL_FILE = "tail.json"
"""A detector's post-processing settings (``exporters.detection_tail.TailSpec``)."""


@dataclass
class Exported:
    onnx: OnnxExport
    """The whole graph (what FP32 serves)."""
    core: Path | None = None
    """The part INT8 quantizes, when it is not the whole graph."""
    tail: Path | None = None
    """The settings of the float tail appended after the core."""


class ModelForm(Protocol):
    logits: bool
    """Its outputs are logits (a classifier): the logit fidelity gate applies."""

    def check(self, model: nn.Module) -> str | None:
        """Why this model cannot be exported, or None."""

    def held_out(self, val: Dataset, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The held-out images and their targets, as arrays."""

    def outputs(self, model: nn.Module, inputs: np.ndarray, batch: int) -> np.ndarray:
        """The PyTorch model's outputs on ``inputs`` in the exported graph's form."""

    def export(self, model: nn.Module, path: Path, shape: tuple[int, int, int],
               cfg: OnnxExportConfig, work: Path) -> Exported: ...


class LogitsForm:
    """A classifier: one logits array out."""

    logits = True

    def check(self, model: nn.Module) -> str | None:
        return None

    def held_out(self, val: Dataset, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
        return held_out(val, limit)

    def outputs(self, model: nn.Module, inputs: np.ndarray, batch: int) -> np.ndarray:
        return predict(TorchRunner(model), inputs, batch=batch)  # type: ignore[no-any-return]

    def export(self, model: nn.Module, path: Path, shape: tuple[int, int, int],
               cfg: OnnxExportConfig, work: Path) -> Exported:
        return Exported(export_onnx(model, path, shape, cfg))


class DetectionForm:
    """A torchvision SSD: padded detections out, NMS in the graph."""

    logits = False

    def check(self, model: nn.Module) -> str | None:
        from exporters.detector_core import detector_unexportable

        return detector_unexportable(model)

    def held_out(self, val: Dataset, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
        from hpc_core.tasks.detection.sources import LABEL_OFFSET

        n = len(val) if limit is None else min(limit, len(val))  # type: ignore[arg-type]
        items = [val[i] for i in range(n)]
        x = torch.stack([im for im, _ in items]).numpy().astype(np.float32)
        targets = [{k: v.numpy() for k, v in t.items()} for _, t in items]
        return x, pack_targets(targets, LABEL_OFFSET)

    def outputs(self, model: nn.Module, inputs: np.ndarray, batch: int) -> np.ndarray:
        from hpc_core.tasks.detection.sources import LABEL_OFFSET

        # torchvision's own post-processing, in eval mode: the reference the graph matches
        dets = predict(TorchRunner(model), inputs, batch=batch)
        return pack_detections(dets, int(model.detections_per_img), LABEL_OFFSET)

    def export(self, model: nn.Module, path: Path, shape: tuple[int, int, int],
               cfg: OnnxExportConfig, work: Path) -> Exported:
        from exporters.detection_tail import attach
        from exporters.detector_core import DetectorCore, image_size_of, tail_spec

        if image_size_of(model) != shape[-1]:
            raise ValueError(f"the detector resizes to {image_size_of(model)} px but exports "
                             f"for {shape[-1]} px: set model.image_size to one size")
        core = export_onnx(DetectorCore(model), work / CORE_FILE, shape, cfg, HEAD_NAME)
        spec = tail_spec(model)
        spec.save(work / TAIL_FILE)
        attach(core.path, spec, path)
        whole = OnnxExport(path=path, opset=core.opset, input_name=core.input_name,
                           output_name="num_detections", simplified_by=core.simplified_by,
                           size_bytes=path.stat().st_size)
        return Exported(whole, core.path, work / TAIL_FILE)


FORMS: dict[str, ModelForm] = {"classification": LogitsForm(), "detection": DetectionForm()}


def form_of(task: str) -> ModelForm:
    """The form of ``task``'s models (``exporters.job.unexportable`` refused the others)."""
    return FORMS[task]
