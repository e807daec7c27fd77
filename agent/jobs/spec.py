"""The device job's spec: what ``agentctl finetune`` and the daemon's ``finetune`` command accept.

It composes the existing job models instead of repeating them: the fine-tune options are
:class:`agent.finetune.job.FinetuneJob` without the paths the job decides itself (checkpoint,
out), the export options are :class:`exporters.pipeline.ExportJob` without its paths and data.
``agentctl finetune`` derives its flags from this model (``hpc_core.job_args``).

Torch-free: the daemon validates commands against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from agent.finetune.job import FinetuneJob
from hpc_core.job_args import flag

JOB_STEPS = ("pull", "finetune", "export", "stage", "health", "commit", "rollback", "upload")


def _without(model: type[BaseModel], name: str, drop: set[str]) -> type[BaseModel]:
    """``model``'s fields minus ``drop``, as a new strict model (docstrings kept for --help)."""
    fields: dict[str, Any] = {
        k: (f.annotation, f) for k, f in model.model_fields.items() if k not in drop
    }
    return create_model(  # type: ignore[call-overload, no-any-return]
        name, __config__=ConfigDict(extra="forbid", use_attribute_docstrings=True), **fields
    )


FinetuneOptions = _without(FinetuneJob, "FinetuneOptions", {"checkpoint", "data", "out"})


class FallbackOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_excluded_layers: int = Field(default=3, ge=0)
    """INT8 retries leave the 1, 2, ... up to this many most sensitive layers in float."""
    fp16: bool = True
    """Try FP16 after the INT8 steps."""
    fp32: bool = True
    """Try FP32 last."""


class ExportOptions(BaseModel):
    """exporters.pipeline.ExportJob without its paths. Its gates, calibration and onnx sections
    are that job's own models; they are checked by :func:`check_export_options` (the exporter
    modules import torch, and the daemon validating a command must not)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    precision: Literal["int8", "fp16", "fp32"] = Field(
        default="int8", json_schema_extra=flag("export-precision")
    )
    """First step of the export's fallback chain: int8 -> fp16 -> fp32."""
    target: Literal["onnxruntime", "tensorrt"] = "onnxruntime"
    """onnxruntime here; tensorrt on a Jetson (builds an engine from the ONNX file)."""
    calibration: dict[str, Any] = Field(default_factory=dict)
    """exporters.calibration.CalibrationConfig fields."""
    onnx: dict[str, Any] = Field(default_factory=dict)
    """exporters.onnx_export.OnnxExportConfig fields."""
    gates: dict[str, Any] = Field(default_factory=dict)
    """exporters.gates.GateConfig fields, e.g. {max_top1_drop_pts: 1.0}."""
    fallback: FallbackOptions = Field(default_factory=FallbackOptions)


def check_export_options(job: DeviceJob) -> None:
    """Validate the export sections against the exporter's models (imports torch)."""
    from exporters.calibration import CalibrationConfig
    from exporters.gates import GateConfig
    from exporters.onnx_export import OnnxExportConfig

    e = job.export
    for name, model, value in (("calibration", CalibrationConfig, e.calibration),
                               ("onnx", OnnxExportConfig, e.onnx), ("gates", GateConfig, e.gates)):
        try:
            model.model_validate(value)
        except ValueError as err:
            raise ValueError(f"export.{name}: {err}") from None




class HealthOptions(BaseModel):
    """The staged model against the active one, on the same held-out device data."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_accuracy_drop_pts: float = Field(default=0.0, ge=0)
    """Largest allowed drop of the staged model's held-out accuracy below the active model's,
    in percentage points (0: it must be at least as good)."""
    min_accuracy: float | None = Field(default=None, ge=0, le=1)
    """Held-out accuracy the staged model must reach regardless of the active one (0..1)."""
    max_latency_ratio: float | None = Field(default=None, gt=0)
    """Largest allowed staged/active ratio of the median batch-1 latency (null: not gated)."""
    samples: int | None = Field(default=None, ge=1)
    """Held-out samples to score (null: the whole held-out split)."""


class UploadOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    registry: str | None = Field(default=None, json_schema_extra=flag("upload-to"))
    """Registry to publish the committed model to (null: the job's --registry)."""
    version: str | None = Field(default=None, json_schema_extra=flag("upload-version"))
    """Version name (null: PARENT+DEVICE.UTCSTAMP)."""


class StepSwitches(BaseModel):
    """Which optional steps run; pull, stage, health and commit/rollback always do."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    export: bool = Field(default=True, json_schema_extra=flag("export"))
    """Export (and gate) an ONNX artefact; without it the staged model carries none and the
    health check runs it in PyTorch."""
    upload: bool = Field(default=False, json_schema_extra=flag("upload"))
    """Publish the committed model back to the registry, signed by this device."""


class DeviceJob(BaseModel):
    """pull -> finetune -> export -> stage -> health -> commit | rollback -> upload."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str = Field(json_schema_extra=flag("model"))
    """Installed model name to fine-tune (its active version is the upstream)."""
    version: str | None = None
    """Upstream version to start from (null: the active one); must be installed."""
    data: Path
    """The device's data: a folder of class sub-folders (PNG/JPEG) or an .npz with x and y."""
    finetune: FinetuneOptions = Field(default_factory=FinetuneOptions)  # type: ignore[valid-type]
    export: ExportOptions = Field(default_factory=ExportOptions)
    health: HealthOptions = Field(default_factory=HealthOptions)
    upload: UploadOptions = Field(default_factory=UploadOptions)
    steps: StepSwitches = Field(default_factory=StepSwitches)
    registry: str | None = None
    """Registry URL or folder (upload target)."""
    trusted_keys: Path | None = None
    """Folder of trusted *.pub.pem keys (null: STATE_DIR/trusted_keys)."""
    signing_key: Path | None = None
    """This device's private key, signs the staged and uploaded model (null:
    STATE_DIR/device.key.pem, its public half beside it as
    device.pub.pem)."""

    @model_validator(mode="after")
    def _check(self) -> DeviceJob:
        ft = self.finetune
        if ft.micro_batch is not None and ft.micro_batch > ft.effective_batch:  # type: ignore[attr-defined]
            raise ValueError(
                f"finetune.micro_batch={ft.micro_batch} exceeds finetune.effective_batch="  # type: ignore[attr-defined]
                f"{ft.effective_batch}: lower --micro-batch or raise --effective-batch"  # type: ignore[attr-defined]
            )
        if self.steps.upload and not (self.upload.registry or self.registry):
            raise ValueError("steps.upload needs a registry: set registry or upload.registry")
        return self

    def planned_steps(self) -> list[str]:
        """The steps this job runs, in order (commit and rollback are alternatives)."""
        steps = ["pull", "finetune"]
        if self.steps.export:
            steps.append("export")
        steps += ["stage", "health", "commit"]
        if self.steps.upload:
            steps.append("upload")
        return steps


def check_inputs(job: DeviceJob) -> None:
    """Checks on the file system that must fail before any probe, download or job folder:
    each raises ValueError naming the option."""
    data = job.data
    if not data.exists():
        raise ValueError(f"--data {data}: no such file or folder")
    if data.is_dir():
        if not any(p.is_dir() and any(p.iterdir()) for p in data.iterdir()):
            raise ValueError(f"--data {data}: empty (no class sub-folder with images)")
    elif data.suffix != ".npz":
        raise ValueError(f"--data {data}: expected a folder of class sub-folders or an .npz")
    elif data.stat().st_size == 0:
        raise ValueError(f"--data {data}: empty file")
    else:
        try:
            import zipfile

            with zipfile.ZipFile(data) as z:
                names = set(z.namelist())
        except (OSError, zipfile.BadZipFile) as e:
            raise ValueError(f"--data {data}: not a readable .npz ({e})") from None
        if not {"x.npy", "y.npy"} <= names:
            raise ValueError(f"--data {data}: the .npz needs arrays x and y")
