"""A job command's ``args`` checked against the device job's own spec models before it is queued.

The models belong to the job (``agent.jobs.spec.SPECS``: finetune -> DeviceJob, deploy ->
DeployJob, rollback -> RollbackJob; torch-free); the daemon only looks them up, so a bad
finetune command is REJECTED with the field's path at once, not FAILED minutes later. The
contract checks the envelope (and rollback's own args) first; the spec is the last word.
"""

from __future__ import annotations

from typing import Any

from agent.mqtt.contract import CommandRejected


def validate_job(
    type_: str, args: dict[str, Any], defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The validated spec as JSON-able data, stored as the job's spec and run by the worker;
    pydantic's ValidationError on bad args, or CommandRejected(UNAVAILABLE) for a job type
    this build cannot run. ``defaults`` (the device's registry, trusted keys and signing key,
    from its config) fill the spec's fields of those names that the command leaves out, so one
    rollout's args fit every device."""
    from agent.jobs.spec import SPECS

    model = SPECS.get(type_)
    if model is None:
        raise CommandRejected(
            "UNAVAILABLE", f"{type_} jobs are not supported by this agent version "
            f"(it runs {', '.join(sorted(SPECS))})"
        )
    known = {k: v for k, v in (defaults or {}).items() if k in model.model_fields}
    return dict(model.model_validate(_under(known, args)).model_dump(mode="json"))


def _under(defaults: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """``args`` laid over ``defaults``, section by section; a None default fills nothing."""
    out = dict(args)
    for k, v in defaults.items():
        if isinstance(v, dict) and isinstance(out.get(k, {}), dict):
            out[k] = _under(v, out.get(k, {}))
        elif out.get(k) is None and v is not None:
            out[k] = v
    return out
