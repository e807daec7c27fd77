"""The torch half of an export: the fine-tuned model loaded (safetensors), pruned and
recovered, exported to FP32 ONNX; the held-out inputs with the reference and fidelity logits
and the calibration inputs drawn — everything the quantizing half (``exporters.pipeline``)
needs, handed over through ``exporters.handoff``. A device job runs each half in its own
process so that torch and ONNX Runtime are never resident together.

What differs by task is a form (:data:`FORMS`): a classifier's outputs are logits and its
targets labels; a detector's (``exporters.detection.form``) are padded detections after NMS
in the graph and packed ground-truth rows, and its ONNX file is a core that INT8 quantizes
with a float tail joined to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from exporters.calibration import representative_inputs
from exporters.detection.form import DetectionForm
from exporters.flops import count_flops
from exporters.handoff import Prepared, write_prepared
from exporters.job import ExportJob, OnnxExportConfig, unexportable
from exporters.onnx_export import Exported, export_onnx
from exporters.onnx_weights import check_semi_structured
from exporters.prune import PruneResult, prune_model
from exporters.recovery import recover
from exporters.report import ExportReport, versions
from exporters.runtime import TorchRunner, predict
from exporters.tensorrt_build import require_tensorrt
from hpc_core.checkpoint import load_model, resolve_checkpoint
from hpc_core.config import DataConfig, TrainConfig
from hpc_core.data import held_out
from hpc_core.tasks import get_task

INSTALLED = ("model.onnx", "model.onnx.json", "model.engine", "model.engine.json", "report.json")


class ModelForm(Protocol):
    """How the torch half reads one task's models (one form per exported task)."""

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


FORMS: dict[str, ModelForm] = {"classification": LogitsForm(), "detection": DetectionForm()}
"""Each exported task's form (``exporters.job.EXPORTED_TASKS``): the steps below call it and
never ask which task they hold."""


def form_of(task: str) -> ModelForm:
    """The form of ``task``'s models (``exporters.job.unexportable`` refused the others)."""
    return FORMS[task]


@dataclass
class Source:
    model: nn.Module
    config: TrainConfig
    checkpoint: Path
    train: Dataset
    val: Dataset
    input_shape: tuple[int, int, int]


def load_source(job: ExportJob) -> Source:
    """The checkpoint's model (safetensors, never unpickled) and the job's data splits."""
    ckpt_dir = resolve_checkpoint(job.checkpoint)
    model, cfg = load_model(ckpt_dir, "cpu")
    m = cfg.model
    why = unexportable(cfg.task, m.name) or form_of(cfg.task).check(model)
    if why is not None:
        raise ValueError(f"{ckpt_dir}: {why}")
    data = cfg.data.model_dump()
    if job.data is not None:  # the fields the job sets override the checkpoint's
        data.update(job.data.model_dump(include=job.data.model_fields_set))
    data = DataConfig.model_validate({**data, "image_size": m.image_size})
    train, val, info = get_task(cfg.task).build_datasets(data)
    if info.in_channels != m.in_channels:
        raise ValueError(
            f"data has {info.in_channels} channel(s) but the model takes {m.in_channels}: "
            "fix data.grayscale or use the model's data"
        )
    if info.num_classes > (m.num_classes or 0):
        raise ValueError(
            f"data has {info.num_classes} classes but the model predicts {m.num_classes}"
        )
    cfg = cfg.model_copy(update={"data": data})
    shape = (int(m.in_channels or 1), int(m.image_size or 1), int(m.image_size or 1))
    return Source(model.eval(), cfg, ckpt_dir, train, val, shape)


def _prune(job: ExportJob, src: Source, model: nn.Module, report: ExportReport) -> bool:
    """Prune and recover ``model`` in place; True when its weights are 2:4."""
    assert job.prune is not None
    example = torch.zeros(1, *src.input_shape)
    result: PruneResult = prune_model(model, job.prune, example)
    report.prune = {
        "spec": job.prune.label,
        "sparsity": result.total_sparsity,
        "layers": [vars(s) for s in result.layers],
    }
    if "channels" in result.extra:
        ch = result.extra["channels"]
        report.prune["channels"] = {k: list(v) for k, v in ch.layers.items()}
        report.prune["channels_kept_whole"] = ch.skipped
    if job.recovery.steps > 0:
        rec = recover(
            model, result.masks, (src.train, src.val), src.config, job.recovery,
            job.out_dir / "work" / "recovery",
        )
        report.recovery = {"steps": rec.steps, "metrics": rec.metrics, "seconds": rec.seconds}
    return job.prune.method == "semi_structured"


def _model_summary(model: nn.Module, shape: tuple[int, ...]) -> dict[str, int]:
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "flops": count_flops(model, shape).total,
    }


def prepare(job: ExportJob) -> Prepared:
    """Run the torch half of ``job`` and write its hand-over into ``<out_dir>/work``."""
    if job.target == "tensorrt":
        require_tensorrt()  # fail before minutes of pruning and calibration
    out, work = job.out_dir, job.out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    for name in INSTALLED:  # a stale artefact must never pass for this job's result
        (out / name).unlink(missing_ok=True)
    report = ExportReport(target=job.target, job=job.model_dump(mode="json"), versions=versions())
    src = load_source(job)
    report.checkpoint = str(src.checkpoint)
    form = form_of(src.config.task)
    if not form.logits and job.gates.max_abs_logit_delta is not None:
        raise ValueError("gates.max_abs_logit_delta: a detector's outputs are boxes after NMS, "
                         "with no logits to compare; unset it (gates.max_map50_drop_pts and "
                         "gates.max_top1_drop_pts gate a detector by mAP)")
    inputs, labels = form.held_out(src.val, job.gates.eval_samples)
    batch = job.gates.batch_size  # every scoring pass: the job's batch, never more
    reference_logits = form.outputs(src.model, inputs, batch)
    before = _model_summary(src.model, src.input_shape)
    model = copy.deepcopy(src.model)
    sparse = _prune(job, src, model, report) if job.prune is not None else False
    after = _model_summary(model, src.input_shape)
    report.model = {
        "name": src.config.model.name,
        "kwargs": src.config.model.kwargs,
        "input_shape": list(src.input_shape),
        "num_classes": src.config.model.num_classes,
        "params_before": before["params"],
        "params_after": after["params"],
        "flops_before": before["flops"],
        "flops_after": after["flops"],
    }
    fidelity_logits = form.outputs(model, inputs, batch)
    exported = form.export(model, out / "model.fp32.onnx", src.input_shape, job.onnx, work)
    fp32 = exported.onnx
    report.onnx = {
        "opset": fp32.opset,
        "exporter": job.onnx.exporter,
        "simplified_by": fp32.simplified_by,
        "fp32_size_bytes": fp32.size_bytes,
    }
    if sparse:
        checks = check_semi_structured(fp32.path)
        eligible = [c for c in checks if c.eligible]
        bad = [c.node for c in eligible if c.violations]
        report.semi_structured = {
            "layers_2_4": len(eligible) - len(bad),
            "eligible_layers": len(eligible),
            "not_2_4": bad,
        }
        if bad or not eligible:
            raise RuntimeError(f"exported weights are not 2:4 in {bad or 'any layer'}")
    c = job.calibration
    calib = representative_inputs(src.train, c.samples, c.seed)
    prepared = Prepared(fp32_path=fp32.path, input_name=fp32.input_name,
                        input_shape=src.input_shape, sparse=sparse, inputs=inputs,
                        labels=labels, reference_logits=reference_logits,
                        fidelity_logits=fidelity_logits, calib=calib, report=report,
                        task=src.config.task, core_path=exported.core,
                        tail_path=exported.tail)
    write_prepared(prepared, work)
    return prepared
