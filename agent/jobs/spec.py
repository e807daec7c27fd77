"""The device job's spec: what ``agentctl finetune`` and the daemon's ``finetune`` command accept.

It composes the existing job models instead of repeating them: the fine-tune options are
:class:`agent.finetune.job.FinetuneJob` without the paths the job decides itself (checkpoint,
out), the export options are :class:`exporters.pipeline.ExportJob` without its paths and data.
``agentctl finetune`` derives its flags from this model (``hpc_core.job_args``).

Torch-free: the daemon validates commands against it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from agent.finetune.job import FinetuneJob
from exporters.job import ExportJob, Precision
from hpc_core.job_args import flag

JOB_STEPS = ("pull", "finetune", "export", "stage", "health", "commit", "rollback", "upload")


def _without(
    model: type[BaseModel], name: str, drop: set[str], *, short_flags: bool = False,
    override: dict[str, tuple[Any, Any]] | None = None,
) -> type[BaseModel]:
    """``model``'s fields minus ``drop``, as a new strict model (docstrings kept for --help).
    ``short_flags`` names each field's flag after the field alone (``--steps``, not
    ``--finetune-steps``) unless it already has a name; ``override`` replaces fields."""
    fields: dict[str, Any] = {}
    for k, f in model.model_fields.items():
        if k in drop:
            continue
        if short_flags and not (isinstance(f.json_schema_extra, dict)
                                and f.json_schema_extra.get("cli")):
            f = copy.copy(f)
            f.json_schema_extra = flag(k.replace("_", "-"))
        fields[k] = (f.annotation, f)
    fields.update(override or {})
    return create_model(  # type: ignore[call-overload, no-any-return]
        name, __config__=ConfigDict(extra="forbid", use_attribute_docstrings=True), **fields
    )


FinetuneOptions = _without(FinetuneJob, "FinetuneOptions", {"checkpoint", "data", "out"},
                           short_flags=True)
"""agent.finetune.job.FinetuneJob without the paths the job decides (checkpoint, data, out)."""

EXPORT_PATHS = {"checkpoint", "out_dir", "data"}
ExportOptions = _without(
    ExportJob, "ExportOptions", EXPORT_PATHS,
    override={"precision": (Precision, Field(
        default="int8", json_schema_extra=flag("export-precision"),
        description="First step of the export's fallback chain: int8 -> fp16 -> fp32."))},
)
"""exporters.job.ExportJob without its paths and data (the job's own model, data and folder):
its sections (gates, calibration, onnx, fallback, tensorrt, prune, recovery) are that job's
typed models; INT8 first."""


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
    """Upstream version to start from (null: the active one). One not on the device is
    fetched from --registry and verified into the job's folder, never a slot: it is only
    trained from, so it may be older than the newest version installed."""
    data: Path
    """The device's data: a folder of class sub-folders (PNG/JPEG) or an .npz with x and y."""
    finetune: FinetuneOptions = Field(default_factory=FinetuneOptions)  # type: ignore[valid-type]
    export: ExportOptions = Field(default_factory=ExportOptions)  # type: ignore[valid-type]
    health: HealthOptions = Field(default_factory=HealthOptions)
    upload: UploadOptions = Field(default_factory=UploadOptions)
    steps: StepSwitches = Field(default_factory=StepSwitches)
    registry: str | None = None
    """Registry URL or folder: where a version not on the device is pulled from, and the
    upload target (unless upload.registry)."""
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
        try:  # FinetuneJob's own field and cross-field checks (e.g. trainable)
            FinetuneJob.model_validate({**ft.model_dump(), "checkpoint": ".", "data": ".",
                                        "out": "."})
        except ValueError as e:
            raise ValueError(f"finetune: {e}") from None
        try:  # ExportJob's own cross-field checks (e.g. tensorrt.max_batch vs gates.batch)
            ExportJob.model_validate({**self.export.model_dump(), "checkpoint": ".",  # type: ignore[attr-defined]
                                      "out_dir": "."})
        except ValueError as e:
            raise ValueError(f"export: {e}") from None
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


class DeployJob(BaseModel):
    """pull -> stage -> health -> commit | rollback of a registry version: the daemon's
    ``deploy`` command. The active model changes only once the staged one passed its check."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str
    """Model name."""
    version: str
    """Version to deploy."""
    registry: str
    """Registry URL or folder to pull it from."""
    data: Path | None = None
    """Held-out device data for the health check (null: the staged model must load and give
    finite outputs; accuracy is not compared)."""
    health: HealthOptions = Field(default_factory=HealthOptions)
    trusted_keys: Path | None = None
    """Folder of trusted *.pub.pem keys (null: STATE_DIR/trusted_keys)."""

    def planned_steps(self) -> list[str]:
        return ["pull", "stage", "health", "commit"]


class RollbackJob(BaseModel):
    """Make the verified standby version active again (the contract's rollback args)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str | None = None
    """Model name (null: the only installed model)."""
    reason: str | None = Field(default=None, max_length=500)
    trusted_keys: Path | None = None

    def planned_steps(self) -> list[str]:
        return ["switch"]


SPECS: dict[str, type[BaseModel]] = {"finetune": DeviceJob, "deploy": DeployJob,
                                     "rollback": RollbackJob}
"""Job type (contract JOB_TYPES) -> its spec model."""


def check_inputs(job: DeviceJob, state_dir: Path | None = None) -> None:
    """Checks on the file system that must fail before any probe, download or job folder:
    each raises ValueError naming the option. With ``state_dir``: the upstream model must be
    readable there (its slot marker and signed manifest), or fetchable (--registry). Reads
    only; creates nothing."""
    data = job.data
    if state_dir is not None:
        _check_upstream(job, Path(state_dir))
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


def _check_upstream(job: DeviceJob, state_dir: Path) -> None:
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    slots = ModelSlots(state_dir, job.model)
    try:
        active = slots.active()
        base = slots.installed(job.version) if active is not None else None
    except RegistryError as e:
        if "not installed" in str(e) and job.registry:
            return  # another version: pull fetches it
        raise ValueError(f"--model {job.model}: the installed checkpoint is unreadable ({e})"
                         if "not installed" not in str(e) else
                         f"--version {job.version}: {e}; give --registry to fetch it") from None
    if base is None and not (job.version and job.registry):
        raise ValueError(f"--model {job.model}: not installed in {state_dir}; give --version "
                         "and --registry to fetch it")
    if base is not None and not (base.path / "model.safetensors").is_file():
        raise ValueError(f"--model {job.model}: the installed checkpoint {base.path} has no "
                         "model.safetensors")
