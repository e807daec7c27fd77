"""A job command's ``args`` checked against the device job's own spec models before it is queued.

The models belong to the job (``agent.jobs.spec``, torch-free); the daemon only looks them up,
so a bad finetune command is REJECTED with the field's path at once, not FAILED minutes later.
"""

from __future__ import annotations

from typing import Any

from agent.mqtt.contract import CHEAP_ARGS, CommandRejected

# Job type -> the name of its spec model in agent.jobs.spec (None: the contract's own args).
_SPEC_MODELS = {"finetune": "DeviceJob", "deploy": "DeployJob", "rollback": None}


def validate_job(type_: str, args: dict[str, Any]) -> dict[str, Any]:
    """The validated spec as JSON-able data; pydantic's ValidationError on bad args, or
    CommandRejected(UNAVAILABLE) for a job type this build cannot run."""
    name = _SPEC_MODELS[type_]
    if name is None:
        return CHEAP_ARGS[type_].model_validate(args).model_dump(mode="json", exclude_none=True)
    from agent.jobs import spec

    model = getattr(spec, name, None)
    if model is None:
        raise CommandRejected(
            "UNAVAILABLE", f"{type_} jobs are not supported by this agent version "
            f"(agent.jobs.spec has no {name})"
        )
    return dict(model.model_validate(args).model_dump(mode="json"))
