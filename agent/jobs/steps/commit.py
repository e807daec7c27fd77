"""commit | rollback: the two ways out of the health check. commit switches ``current`` to the
staged version (one atomic rename); rollback drops it, the active model untouched. The only
steps that change which model serves. Before the switch, commit waits while an application
holds the model's update lock (agent.runtime.update_lock), at most the device's
``update_lock_max_wait_s``; the wait is in its output."""

from __future__ import annotations

import time
from typing import Any

from agent.jobs.protocol import Canceled, JobContext, StepFailed, Suspended, TimedOut


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    staged = ctx.outputs["stage"]
    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    digest = staged.get("manifest_sha256")

    def is_staged(slot: Any) -> bool:
        # Identity, not name: the very manifest staged (every tensor's hash), or for a job
        # staged before digests were recorded the version and the sequence it signed.
        if slot is None or slot.version != staged["version"]:
            return False
        if digest is not None:
            return bool(slot.manifest_sha256 == digest)
        return bool(slot.manifest.sequence == staged.get("sequence", slot.manifest.sequence))

    waited = 0.0
    if not is_staged(slots.active()):  # else a resumed commit that had already switched
        from agent.runtime.update_lock import wait_for_update_locks

        if not is_staged(slots.standby()):
            raise StepFailed("commit", _lost(staged, slots.standby()))
        waited = wait_for_update_locks(ctx.state_dir, ctx.spec.model,
                                       ctx.spec.update_lock_max_wait_s,
                                       check=lambda: _still_wanted(ctx))
        try:
            slots.commit(staged["version"], manifest_sha256=digest)
        except RegistryError as e:  # replaced while waiting: the job fails, it does not crash
            raise StepFailed("commit", f"{_lost(staged, slots.standby())} ({e})") from None
    active = slots.active()
    if not is_staged(active):
        raise StepFailed("commit", f"the active version is {getattr(active, 'version', None)} "
                         f"after committing {staged['version']}", code="INTERNAL")
    return {"version": active.version, "slot": active.slot,
            "sequence": active.manifest.sequence, "update_lock_wait_s": round(waited, 3)}


def _lost(staged: dict[str, Any], standby: Any) -> str:
    now = "nothing" if standby is None else (
        f"{standby.version} (manifest sha256 {standby.manifest_sha256[:16]})")
    return (f"the version this job staged, {staged['version']}, is no longer in the standby "
            f"slot (it holds {now}): another job or a pull replaced it; nothing committed")


def _still_wanted(ctx: JobContext) -> None:
    # A wait of minutes must still answer SIGTERM (systemd kills at 30 s), a cancel and the
    # job's timeout, as the machine does between steps.
    if ctx.stop:
        raise Suspended("SIGTERM while waiting for the update lock")
    if ctx.store.cancel_requested(ctx.job_id):
        raise Canceled("canceled while waiting for the update lock")
    if ctx.deadline is not None and time.time() > ctx.deadline:
        raise TimedOut("timeout_s passed while waiting for the update lock")


def rollback(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    staged = slots.standby()
    mine = ctx.outputs.get("stage", {})
    # Only this job's own staged version (never one another job or a pull put there since,
    # and never a committed one: the rollback target).
    if staged is not None and not staged.committed \
            and staged.holds(mine.get("version"), mine.get("manifest_sha256")):
        slots.discard_staged()
    active = slots.active()
    return {"why": "; ".join(ctx.outputs.get("health", {}).get("failures", [])) or "job ended",
            "active": active.version if active else None}
