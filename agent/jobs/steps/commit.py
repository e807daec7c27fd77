"""commit | rollback: the two ways out of the health check. commit switches ``current`` to the
staged version (one atomic rename); rollback drops it, the active model untouched. The only
steps that change which model serves."""

from __future__ import annotations

from typing import Any

from agent.jobs.protocol import JobContext, StepFailed


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    staged = ctx.outputs["stage"]
    slots = ModelSlots(ctx.state_dir, ctx.spec.model)

    def is_staged(slot: Any) -> bool:
        # Identity, not name: the version and the sequence it was signed with.
        return slot is not None and slot.version == staged["version"] and (
            slot.manifest.sequence == staged.get("sequence", slot.manifest.sequence))

    if not is_staged(slots.active()):  # else a resumed commit that had already switched
        slots.commit(staged["version"])
    active = slots.active()
    if not is_staged(active):
        raise StepFailed("commit", f"the active version is {getattr(active, 'version', None)} "
                         f"after committing {staged['version']}", code="INTERNAL")
    return {"version": active.version, "slot": active.slot,
            "sequence": active.manifest.sequence}


def rollback(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    staged = slots.standby()
    staged_version = ctx.outputs.get("stage", {}).get("version")
    if staged is not None and staged.version == staged_version:
        slots.discard_staged()
    active = slots.active()
    return {"why": "; ".join(ctx.outputs.get("health", {}).get("failures", [])) or "job ended",
            "active": active.version if active else None}
