"""What the model's task allows a fine-tune job, checked when the job is submitted (the
daemon's command, ``agentctl finetune``) where the upstream version is installed: its data in
a layout the task reads, and no export where the task has none (a detector). A version not on
the device is checked the same way by the fine-tune step, after its pull and before anything
trains. Torch-free: the signed manifest names the task."""

from __future__ import annotations

from pathlib import Path


def installed_task(state_dir: Path, model: str, version: str | None) -> str | None:
    """The task of ``model`` (``version``, or the active one) installed in ``state_dir``;
    None when it is not there (a version to fetch) or cannot be read (pull will say why)."""
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    try:
        return str(ModelSlots(state_dir, model).installed(version).manifest.model.task)
    except (RegistryError, OSError, ValueError):
        return None


def task_refusal(task: str | None, data: Path, export: bool) -> tuple[str, str] | None:
    """(the field to blame, why) when a job of a ``task`` model cannot run on ``data`` or
    ``export`` it; None when it can, or when the task is not known yet (None)."""
    from agent.finetune.data_source import data_source
    from agent.spool.config import is_spool
    from exporters.job import unexportable

    if task is None:
        return None
    why = unexportable(task) if export else None
    if why is not None:
        return "steps.export", why
    if not is_spool(data):  # a spool is checked on its snapshot, by the fine-tune step
        try:
            data_source(data, task)
        except ValueError as e:
            return "data", str(e)
    return None
