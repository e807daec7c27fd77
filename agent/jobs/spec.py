"""The device job's spec, in two forms with one set of knobs.

- **As received** (:data:`COMMAND_ARGS`: :class:`FinetuneArgs`, :class:`DeployArgs`,
  :class:`RollbackArgs`): what a ``finetune``/``deploy``/``rollback`` command may carry, over
  MQTT or the control socket. Names and numbers only: the model, the version, job knobs, and
  *names* (``data: cam0``, ``export.tensorrt.timing_cache: orin``) that the device resolves
  under roots of its own. No key, registry, upload target or path: extra fields are refused.
- **Resolved** (:data:`SPECS`: :class:`DeviceJob`, :class:`DeployJob`, :class:`RollbackJob`):
  what the worker runs. ``agent.jobs.resolve`` builds it from the args and the device's
  settings (``agent.yaml``); ``agentctl finetune`` run in the foreground by
  root builds it from its flags, paths included.

The knobs compose the existing job models instead of repeating them: the fine-tune options
are :class:`agent.finetune.job.FinetuneJob` without the paths the job decides itself
(checkpoint, out), the export options :class:`exporters.pipeline.ExportJob` without its paths
and data. ``agentctl finetune`` derives its flags from :class:`DeviceJob`
(``hpc_core.job_args``).

Torch-free: the daemon validates commands against it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    model_validator,
)

from agent.finetune.job import FinetuneJob, PersonalPart
from agent.jobs.evaluate_spec import EvaluateArgs, EvaluateJob
from agent.jobs.names import ModelName, Name, Version
from exporters.job import ExportJob, Precision, TensorRTConfig
from hpc_core.job_args import flag
from registry.validation import field_docs

JOB_STEPS = ("pull", "finetune", "export", "stage", "health", "commit", "rollback", "upload")


def _without(
    model: type[BaseModel], name: str, drop: set[str], *, short_flags: bool = False,
    override: dict[str, tuple[Any, Any]] | None = None,
) -> type[BaseModel]:
    """``model``'s fields minus ``drop``, as a new strict model (docstrings kept for --help).
    ``short_flags`` names each field's flag after the field alone (``--steps``, not
    ``--finetune-steps``) unless it already has a name; ``override`` replaces fields."""
    fields: dict[str, Any] = {}
    docs = field_docs(model)  # a model made here has no source to read them from
    for k, f in model.model_fields.items():
        if k in drop:
            continue
        f = copy.copy(f)
        f.description = docs[k] or None
        if short_flags and not (isinstance(f.json_schema_extra, dict)
                                and f.json_schema_extra.get("cli")):
            f.json_schema_extra = flag(k.replace("_", "-"))
        fields[k] = (f.annotation, f)
    fields.update(override or {})
    return create_model(  # type: ignore[call-overload, no-any-return]
        name, __config__=ConfigDict(extra="forbid"), **fields
    )


FinetuneOptions = _without(FinetuneJob, "FinetuneOptions",
                           {"checkpoint", "data", "out", "app_latency"}, short_flags=True)
"""agent.finetune.job.FinetuneJob without what the job decides (checkpoint, data, out, and
where the application's latency is read)."""

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

TensorRTArgs = _without(TensorRTConfig, "TensorRTArgs", {"timing_cache"}, override={
    "timing_cache": (Name | None, Field(default=None, description=(
        "Name of a kernel timing cache kept by the device (STATE_DIR/cache/tensorrt/NAME), "
        "read if present and written back after the build (null: the job's own)")))})
ExportArgs = _without(ExportOptions, "ExportArgs", set(), override={
    "tensorrt": (TensorRTArgs, Field(default_factory=TensorRTArgs))})
"""ExportOptions as a command carries them: the TensorRT timing cache is a name."""


class HealthOptions(BaseModel):
    """The staged model against the active one, on the same held-out device data."""

    model_config = ConfigDict(extra="forbid")

    max_accuracy_drop_pts: float = Field(default=0.0, ge=0)
    """Largest allowed drop of the staged model's held-out accuracy below the active model's,
    in points (0: at least as good). Accuracy: the gate metric of the model's task, top-1 of a
    classifier, COCO mAP@0.5:0.95 of a detector (undefined, nan, never passes)."""
    min_accuracy: float | None = Field(default=None, ge=0, le=1)
    """Held-out accuracy (the task's gate metric, as above) the staged model must reach
    regardless of the active one (0..1)."""
    max_latency_ratio: float | None = Field(default=None, gt=0)
    """Largest allowed staged/active ratio of the median batch-1 latency (null: not gated)."""
    samples: int | None = Field(default=None, ge=1)
    """Held-out samples to score (null: the whole held-out split)."""
    max_anchor_drop_pts: float | None = Field(default=20.0, ge=0)
    """Largest allowed drop, in points, of the staged model's accuracy on the upstream's anchor
    set below the active model's: held-out data of the upstream distribution, shipped with
    the upstream version as the artefact ``anchor.safetensors`` (x, y). A fine-tune that forgets
    what the fleet knows is refused (null: scored, not gated; no anchor: nothing to score)."""


class UploadOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    registry: str | None = Field(default=None, json_schema_extra=flag("upload-to"))
    """Registry to publish the committed model to (null: the job's --registry). The daemon
    sets it from agent.yaml (registry.upload_url); a command cannot."""
    version: str | None = Field(default=None, json_schema_extra=flag("upload-version"))
    """Version name (null: PARENT+DEVICE.UTCSTAMP)."""


class UploadArgs(BaseModel):
    """The upload section a command may carry: where to publish is the device's to say."""

    model_config = ConfigDict(extra="forbid")

    version: Version | None = None
    """Version name (null: PARENT+DEVICE.UTCSTAMP)."""


class StepSwitches(BaseModel):
    """Which optional steps run; pull, stage, health and commit/rollback always do."""

    model_config = ConfigDict(extra="forbid")

    export: bool = Field(default=True, json_schema_extra=flag("export"))
    """Export (and gate) an ONNX artefact; without it the staged model carries none and the
    health check runs it in PyTorch. FCOS and RetinaNet detectors have no export yet: false."""
    upload: bool = Field(default=False, json_schema_extra=flag("upload"))
    """Publish the committed model back to the registry, signed by this device."""


class DeviceJob(BaseModel):
    """pull -> finetune -> export -> stage -> health -> commit | rollback -> upload: the
    resolved job the worker runs (from a command: :func:`resolve`; from ``agentctl
    finetune`` in the foreground: its flags)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(json_schema_extra=flag("model"))
    """Installed model name to fine-tune (its active version is the upstream)."""
    version: str | None = None
    """Upstream version to start from (null: the active one). One not on the device is
    fetched from --registry and verified into the job's folder, never a slot: it is only
    trained from, so it may be older than the newest version installed."""
    data: Path
    """The device's data: a folder of class sub-folders (PNG/JPEG) or an .npz with x and y;
    or a spool (``agent.spool``), trained on through a snapshot taken into the job's folder
    when the fine-tune step starts; for a detector, a COCO or a YOLO folder."""
    finetune: FinetuneOptions = Field(default_factory=FinetuneOptions)  # type: ignore[valid-type]
    export: ExportOptions = Field(default_factory=ExportOptions)  # type: ignore[valid-type]
    health: HealthOptions = Field(default_factory=HealthOptions)
    upload: UploadOptions = Field(default_factory=UploadOptions)
    steps: StepSwitches = Field(default_factory=StepSwitches)
    registry: str | None = None
    """Registry URL or folder: where a version not on the device is pulled from, and the
    upload target (unless upload.registry). The daemon sets it from agent.yaml."""
    trusted_keys: Path | None = None
    """Folder of trusted *.pub.pem keys (null: STATE_DIR/trusted_keys). The daemon sets it
    from agent.yaml."""
    signing_key: Path | None = None
    """This device's private key, signs the staged and uploaded model (null:
    STATE_DIR/device.key.pem, its public half beside it as device.pub.pem). The daemon sets
    it from agent.yaml."""
    latency_slo_ms: float | None = Field(default=None, gt=0)
    """The application's inference p99 objective: while a serving runtime of the model on
    this device reports a p99 over it, training yields (null: the SLO the application
    states, if any). The daemon sets it from agent.yaml."""
    update_lock_max_wait_s: float = Field(default=300.0, ge=0, json_schema_extra=flag(skip=True))
    """Longest the commit waits while an application holds the model's update lock (s). The
    daemon sets it from agent.yaml (limits.update_lock_max_wait_s); a command cannot."""

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

    def skipped_steps(self) -> set[str]:
        """The optional steps this job leaves out (``agent.jobs.machine`` raises ``skip``)."""
        return {s for s in ("export", "upload") if not getattr(self.steps, s)}


class DeployJob(BaseModel):
    """pull -> [personalize] -> stage -> health -> commit | rollback of a registry version:
    the daemon's ``deploy`` command. The active model changes only once the staged one passed
    its check."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """Model name."""
    version: str
    """Version to deploy."""
    registry: str
    """Registry URL or folder to pull it from (the daemon's: agent.yaml registry.url)."""
    data: Path | None = None
    """Held-out device data for the health check (null: the staged model must load and give
    finite outputs; accuracy is not compared)."""
    health: HealthOptions = Field(default_factory=HealthOptions)
    trusted_keys: Path | None = None
    """Folder of trusted *.pub.pem keys (null: STATE_DIR/trusted_keys)."""
    update_lock_max_wait_s: float = Field(default=300.0, ge=0)
    """Longest the commit waits while an application holds the model's update lock (s). The
    daemon sets it from agent.yaml (limits.update_lock_max_wait_s); a command cannot."""
    personal: list[PersonalPart] = Field(default_factory=list, max_length=2)
    """Personalized serving: keep these parts of the device's own model (its active one) in
    the version deployed (``head``: FedPer's own classifier; ``norm``: FedBN's own
    normalization). The result is the device's own version of the release, signed with its
    key like a fine-tune (its lineage names the release). Empty: the release as published;
    a device with no model of its own takes the release as published too."""

    def skipped_steps(self) -> set[str]:
        return set() if self.personal else {"personalize"}


class RollbackJob(BaseModel):
    """Make the verified standby version active again (the contract's rollback args)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    """Model name (null: the only installed model)."""
    reason: str | None = Field(default=None, max_length=500)
    trusted_keys: Path | None = None

    def skipped_steps(self) -> set[str]:
        return set()


SPECS: dict[str, type[BaseModel]] = {"finetune": DeviceJob, "deploy": DeployJob,
                                     "rollback": RollbackJob, "evaluate": EvaluateJob}
"""Job type (contract JOB_TYPES) -> the resolved spec the worker runs."""


# -- what a command may carry ------------------------------------------------------------------


class FinetuneArgs(BaseModel):
    """The ``finetune`` command's args: a :class:`DeviceJob` without the device's own
    settings (registry, trusted keys, signing key, upload target) and with names for paths."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName
    """Installed model name to fine-tune (its active version is the upstream)."""
    version: Version | None = None
    """Upstream version to start from (null: the active one); one not on the device is
    fetched from the device's registry."""
    data: Name
    """Name of a data set under the device's data_root (agent.yaml): a folder of class
    sub-folders or an .npz (a detector: a COCO or YOLO folder); or ``spool``: the samples the
    device recorded for this model (data_root/spool/MODEL), trained on through a snapshot
    taken when the fine-tune starts."""
    finetune: FinetuneOptions = Field(default_factory=FinetuneOptions)  # type: ignore[valid-type]
    export: ExportArgs = Field(default_factory=ExportArgs)  # type: ignore[valid-type]
    health: HealthOptions = Field(default_factory=HealthOptions)
    upload: UploadArgs = Field(default_factory=UploadArgs)
    steps: StepSwitches = Field(default_factory=StepSwitches)


class DeployArgs(BaseModel):
    """The ``deploy`` command's args: a version of the device's registry, checked on a data
    set of its own."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName
    version: Version
    data: Name | None = None
    """Held-out data set under data_root for the health check (null: load and finite
    outputs only)."""
    health: HealthOptions = Field(default_factory=HealthOptions)
    personal: list[PersonalPart] = Field(default_factory=list, max_length=2)
    """Personalized serving: keep these parts of the device's own model in the release
    (``head``, ``norm``); the device signs the result as its own version of the release."""


class RollbackArgs(BaseModel):
    """The ``rollback`` command's args."""

    model_config = ConfigDict(extra="forbid")

    name: ModelName | None = None
    """Model name (null: the only installed model)."""
    reason: str | None = Field(default=None, max_length=500)


COMMAND_ARGS: dict[str, type[BaseModel]] = {"finetune": FinetuneArgs, "deploy": DeployArgs,
                                            "rollback": RollbackArgs, "evaluate": EvaluateArgs}
"""Job type -> the allow-list of what its command may carry (extra fields are refused)."""
