"""switch: the rollback job's one step: the verified standby version becomes active again."""

from __future__ import annotations

from typing import Any

from agent.jobs.protocol import JobContext, StepFailed, trusted_keys


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    slots = ModelSlots(ctx.state_dir, ctx.model_name())
    trusted = trusted_keys(ctx)  # a bad trusted-keys folder fails the job as itself
    try:
        res = slots.rollback(trusted)
    except RegistryError as e:
        raise StepFailed("switch", str(e), code="NOT_FOUND") from None
    return {"version": res.active.version, "slot": res.active.slot,
            "previous": res.previous.version if res.previous else None}
