"""A detector in the torch half of an export (``exporters.prepare``): its held-out targets
packed as rows, torchvision's own detections as the reference, and its ONNX graph, the core
(``exporters.detection.core``) with decoding and NMS appended (``exporters.detection.tail``);
the core alone is what INT8 quantizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from exporters.detection.core import DetectorCore, detector_unexportable, image_size_of, tail_spec
from exporters.detection.outputs import HEAD_NAME, pack_detections, pack_targets
from exporters.detection.tail import attach
from exporters.job import OnnxExportConfig
from exporters.onnx_export import Exported, OnnxExport, export_onnx
from exporters.runtime import TorchRunner, predict
from hpc_core.tasks.detection.sources import LABEL_OFFSET

CORE_FILE = "core.fp32.onnx"
"""A detector's quantizable core, in the export's work folder."""
TAIL_FILE = "tail.json"
"""A detector's post-processing settings (``exporters.detection.tail.TailSpec``)."""


class DetectionForm:
    """A torchvision SSD: padded detections out, NMS in the graph."""

    logits = False

    def check(self, model: nn.Module) -> str | None:
        return detector_unexportable(model)

    def held_out(self, val: Dataset, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
        n = len(val) if limit is None else min(limit, len(val))  # type: ignore[arg-type]
        items = [val[i] for i in range(n)]
        x = torch.stack([im for im, _ in items]).numpy().astype(np.float32)
        targets = [{k: v.numpy() for k, v in t.items()} for _, t in items]
        return x, pack_targets(targets, LABEL_OFFSET)

    def outputs(self, model: nn.Module, inputs: np.ndarray, batch: int) -> np.ndarray:
        # torchvision's own post-processing, in eval mode: the reference the graph matches
        dets = predict(TorchRunner(model), inputs, batch=batch)
        return pack_detections(dets, int(model.detections_per_img), LABEL_OFFSET)

    def export(self, model: nn.Module, path: Path, shape: tuple[int, int, int],
               cfg: OnnxExportConfig, work: Path) -> Exported:
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
