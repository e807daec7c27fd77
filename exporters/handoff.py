"""What the torch half of an export (``exporters.prepare``) hands the quantizing half
(``exporters.pipeline``): the FP32 ONNX file, the held-out inputs and labels, the reference
and fidelity logits, the calibration inputs, and the report so far. A detector's labels are
its ground-truth boxes packed as rows and its "logits" its padded detections
(``exporters.detection.outputs``); its quantizable core and the settings of its float tail
travel as two more paths.

Two processes on a device: the dynamo exporter and a recovery fine-tune need torch, the
quantization and the gates need ONNX Runtime, and one process holding both peaked 1.2 x the
job's memory budget (48 px resnet at 450 MB); each alone stays within it. Arrays go through
one ``.npz`` read without pickle, the rest through JSON, both written atomically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from exporters.report import ExportReport
from registry.atomic import atomic_output, write_json_atomic

ARRAYS = ("inputs", "labels", "reference_logits", "fidelity_logits", "calib")


@dataclass
class Prepared:
    fp32_path: Path
    input_name: str
    input_shape: tuple[int, int, int]
    sparse: bool
    """The weights are 2:4 (TensorRT builds with sparse weights)."""
    inputs: np.ndarray
    labels: np.ndarray
    reference_logits: np.ndarray
    """The fine-tuned model's logits on ``inputs`` (what accuracy is compared with)."""
    fidelity_logits: np.ndarray
    """The pruned model's logits (what an artefact's logit delta is measured against)."""
    calib: np.ndarray
    """Calibration inputs drawn from the training split."""
    report: ExportReport
    task: str = "classification"
    """The model's task (``hpc_core.tasks``): its gate metric scores every artefact."""
    core_path: Path | None = None
    """The part of ``fp32_path`` that INT8 quantizes, when not all of it (a detector's network
    without its decoding and NMS)."""
    tail_path: Path | None = None
    """The settings of the float tail joined to the quantized core
    (``exporters.detection.tail.TailSpec``)."""


def _paths(work: Path) -> tuple[Path, Path]:
    return work / "prepared.json", work / "prepared.npz"


def write_prepared(p: Prepared, work: Path) -> None:
    meta, arrays = _paths(work)
    with atomic_output(arrays) as tmp, open(tmp, "wb") as f:
        np.savez(f, **{k: getattr(p, k) for k in ARRAYS})
    report = p.report.to_dict()
    report.pop("attempts")
    write_json_atomic(meta, {
        "fp32_path": str(p.fp32_path), "input_name": p.input_name,
        "input_shape": list(p.input_shape), "sparse": p.sparse, "report": report,
        "task": p.task, "core_path": str(p.core_path) if p.core_path else None,
        "tail_path": str(p.tail_path) if p.tail_path else None,
    })


def read_prepared(work: Path) -> Prepared:
    """The torch half's output; a missing file means that half has not run (or not to
    its end) for this job."""
    meta_path, arrays_path = _paths(work)
    if not meta_path.exists() or not arrays_path.exists():
        raise FileNotFoundError(f"{work}: the export's first half (prune, FP32 ONNX, reference "
                                "logits) has not completed")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    with np.load(arrays_path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in ARRAYS}
    known = {f.name for f in fields(ExportReport)} - {"attempts"}
    report = ExportReport(**{k: v for k, v in meta["report"].items() if k in known})
    shape = tuple(int(d) for d in meta["input_shape"])
    return Prepared(fp32_path=Path(meta["fp32_path"]), input_name=meta["input_name"],
                    input_shape=(shape[0], shape[1], shape[2]), sparse=bool(meta["sparse"]),
                    report=report, task=str(meta.get("task", "classification")),
                    core_path=_path(meta.get("core_path")), tail_path=_path(meta.get("tail_path")),
                    **arrays)


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)
