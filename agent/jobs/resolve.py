"""What a command resolves to on this device: the device's own settings (agent.yaml) and
:func:`resolve`, which turns a command's validated args (:data:`agent.jobs.spec.COMMAND_ARGS`)
into the job the worker runs (:data:`agent.jobs.spec.SPECS`), names resolved under the
device's roots. ArgsRefused names the arg to blame when it cannot run here.

Torch-free: the daemon resolves commands with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.finetune.job import spool_too_small
from agent.finetune.memory_fits import submitted_refusal
from agent.jobs.evaluate_spec import EvaluateArgs, EvaluateJob
from agent.jobs.spec import (
    DeployArgs,
    DeployJob,
    DeviceJob,
    FinetuneArgs,
    RollbackArgs,
    RollbackJob,
)
from agent.jobs.task_checks import installed_task, task_refusal
from agent.spool.config import MARKER, SPOOL_DATA, is_spool, spool_dir


class DeviceSettings(BaseModel):
    """What the device's own configuration (agent.yaml) says about where jobs read, write,
    pull from and upload to, and whom they trust: everything a command may not say."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state_dir: Path
    data_root: Path
    """Data sets a command names live here."""
    registry: str | None
    """Where versions are pulled from (null: only installed versions can be used)."""
    upload_registry: str | None
    """Where the device publishes its fine-tunes (null: registry)."""
    trusted_keys: Path
    signing_key: Path
    profile: str = "auto"
    """The board's profile: a fine-tune's, unless its command names another."""
    sensors: Literal["auto", "jtop", "tegrastats", "sysfs", "sim", "none"] = "auto"
    latency_slo_ms: float | None = None
    """The application's p99 objective training yields to (null: the application's own)."""
    update_lock_max_wait_s: float = Field(default=300.0, ge=0)
    """Longest a commit waits for applications holding the model's update lock (s)."""

    @property
    def timing_caches(self) -> Path:
        return self.state_dir / "cache" / "tensorrt"

    def spool(self, model: str) -> Path:
        """Where ``model``'s recorded samples live (``agent.spool``): data_root/spool/MODEL."""
        return spool_dir(self.data_root, model)


class ArgsRefused(ValueError):
    """A command's args that validate but cannot be resolved on this device; ``field`` is
    the path of the arg to blame (``data``, ``steps.upload``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def resolve_data(name: str, settings: DeviceSettings, field: str = "data") -> Path:
    """``data_root/name``, which must exist and must not lead out of data_root.
    ``spool`` is refused: data_root/spool holds the spools, and only a fine-tune trains on
    one (:func:`resolve_spool`)."""
    root = settings.data_root.resolve()
    if name == SPOOL_DATA:
        raise ArgsRefused(field, f"{SPOOL_DATA!r} names the samples this device records "
                          "(data_root/spool), which only a finetune job trains on: name a "
                          "data set of data_root")
    return _inside(root, root / name, field, f"no data set {name!r} in the device's "
                   f"data_root {root}")


def resolve_spool(model: str, settings: DeviceSettings, field: str = "data") -> Path:
    """``data: spool``: data_root/spool/MODEL, which must hold a spool (agent.spool)."""
    root = settings.data_root.resolve()
    path = spool_dir(root, model)
    _inside(root, path, field, f"no spool for {model} in {path.parent}: nothing recorded "
            "for this model yet (the runtime records into it), or name a data set of "
            "data_root")
    if not is_spool(path):
        raise ArgsRefused(field, f"{path} is not a spool (no {MARKER})")
    return path


def _inside(root: Path, path: Path, field: str, missing: str) -> Path:
    try:
        real = path.resolve(strict=True)
    except OSError:
        raise ArgsRefused(field, missing) from None
    if real != root and root not in real.parents:
        raise ArgsRefused(field, f"{path} leads out of data_root {root}")
    return path


def resolve(type_: str, args: BaseModel, settings: DeviceSettings) -> BaseModel:
    """The job the worker runs for a command's validated ``args`` on this device:
    ArgsRefused (or pydantic's ValidationError from the resolved model's own cross-field
    checks) when it cannot run here."""
    if isinstance(args, RollbackArgs):
        return RollbackJob(name=args.name, reason=args.reason,
                           trusted_keys=settings.trusted_keys)
    if isinstance(args, DeployArgs):
        if not settings.registry:
            raise ArgsRefused("version", "this device has no registry to deploy from "
                              "(registry.url in agent.yaml)")
        return DeployJob(
            model=args.model, version=args.version, registry=settings.registry,
            data=resolve_data(args.data, settings) if args.data else None,
            health=args.health, trusted_keys=settings.trusted_keys,
            update_lock_max_wait_s=settings.update_lock_max_wait_s, personal=args.personal)
    if isinstance(args, EvaluateArgs):
        return EvaluateJob(model=args.model, version=args.version,
                           data=resolve_data(args.data, settings), evaluate=args.evaluate,
                           registry=settings.registry, trusted_keys=settings.trusted_keys)
    if not isinstance(args, FinetuneArgs):
        raise TypeError(f"no resolution for {type_} args {type(args).__name__}")
    upload_to = settings.upload_registry or settings.registry
    if args.steps.upload and not upload_to:
        raise ArgsRefused("steps.upload", "this device has no registry to upload to "
                          "(registry.url or registry.upload_url in agent.yaml)")
    ft = args.finetune.model_dump()  # type: ignore[attr-defined]
    # The board's own profile and sensors pace the fine-tune unless the command names them.
    for k in ("profile", "sensors"):
        if k not in args.finetune.model_fields_set:  # type: ignore[attr-defined]
            ft[k] = getattr(settings, k)
    export = args.export.model_dump()  # type: ignore[attr-defined]
    cache = export["tensorrt"]["timing_cache"]
    if cache is not None:
        export["tensorrt"]["timing_cache"] = str(settings.timing_caches / cache)
    if args.data == SPOOL_DATA:
        data = resolve_spool(args.model, settings)
        # Refused now rather than after the pull; the fine-tune's snapshot checks again.
        why = spool_too_small(data, ft["effective_batch"], ft["val_fraction"])
        if why is not None:
            raise ArgsRefused("data", why)
    else:
        data = resolve_data(args.data, settings)
    refused = task_refusal(installed_task(settings.state_dir, args.model, args.version), data,
                           args.steps.export)
    if refused is not None:  # a detector asked to export, or given classification data
        raise ArgsRefused(*refused)
    why = submitted_refusal(settings.state_dir, args.model, args.version, data, ft)
    if why is not None:  # from this device's last probes of the same job
        raise ArgsRefused("finetune.micro_batch", why)
    return DeviceJob.model_validate({
        "model": args.model, "version": args.version,
        "data": data, "finetune": ft, "export": export,
        "health": args.health.model_dump(),
        "upload": {"registry": upload_to, "version": args.upload.version},
        "steps": args.steps.model_dump(), "registry": settings.registry,
        "trusted_keys": settings.trusted_keys, "signing_key": settings.signing_key,
        "latency_slo_ms": settings.latency_slo_ms,
        "update_lock_max_wait_s": settings.update_lock_max_wait_s})
