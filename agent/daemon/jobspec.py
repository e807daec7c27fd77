"""A job command's ``args``: checked against the job's allow-list, then resolved on this device.

Two models per job type, both the job's own (``agent.jobs.spec``; torch-free): the args a
command may carry (``COMMAND_ARGS``: finetune -> FinetuneArgs, deploy -> DeployArgs,
rollback -> RollbackArgs; ``extra="forbid"``, names instead of paths) and the resolved spec the
worker runs (``SPECS``), which takes every registry, key, upload target and path from the
device's :class:`~agent.jobs.resolve.DeviceSettings` (agent.yaml). A command that tries to set
one of those is REJECTED BAD_ARGS naming the field, at once, not FAILED minutes later. The
contract checks the envelope (and rollback's own args) first; the spec is the last word.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from agent.jobs.resolve import DeviceSettings
from contract import CommandRejected, error_from_validation


def resolve_command_args(
    type_: str, args: dict[str, Any], settings: DeviceSettings
) -> dict[str, Any]:
    """The resolved spec as JSON-able data, stored as the job's spec and run by the worker.
    pydantic's ValidationError on args outside the allow-list, CommandRejected(BAD_ARGS)
    on args this device cannot resolve (a data set it does not have, an upload with no
    registry configured), CommandRejected(UNAVAILABLE) for a job type this build cannot run."""
    from agent.jobs.resolve import ArgsRefused, resolve
    from agent.jobs.spec import COMMAND_ARGS

    model = COMMAND_ARGS.get(type_)
    if model is None:
        raise CommandRejected(
            "UNAVAILABLE", f"{type_} jobs are not supported by this agent version "
            f"(it runs {', '.join(sorted(COMMAND_ARGS))})"
        )
    args_model = model.model_validate(args)
    try:
        spec = resolve(type_, args_model, settings)
    except ArgsRefused as e:
        raise CommandRejected("BAD_ARGS", f"args.{e}") from None
    except ValidationError as e:  # the resolved job's own cross-field checks
        raise CommandRejected("BAD_ARGS", error_from_validation(e).message) from None
    return dict(spec.model_dump(mode="json"))
