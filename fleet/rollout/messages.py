"""How a rollout's executions meet the contract's messages: the command a device receives for
an execution (the plan's job, a rollback, or the cancel of an earlier attempt; it expires at
the controller's own deadline), how a device's terminal result lands on its execution (status,
error, the JobOutcome's outcome and the abort metric before and after), and where a DUPLICATE
answer stands when the device did not say.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from pydantic import ValidationError

from contract import Command, JobOutcome, Result, Topics
from fleet.rollout.plan import abort_metric_of
from fleet.rollout.run import RolloutRun
from fleet.rollout.store import Execution

log = logging.getLogger("fleet.controller")  # runs inside the controller's loop


def command_for(topics: Topics, run: RolloutRun, e: Execution) -> tuple[str, bytes]:
    """The topic and payload of the command a device receives for ``e``: the plan's job,
    the rollback of the rollout, or the cancel of an earlier attempt."""
    p = run.plan
    sent = datetime.fromtimestamp(e.sent_at or time.time(), timezone.utc)
    if e.kind == "job":
        type_, args = p.job, p.args
    elif e.kind == "rollback":
        type_, args = "rollback", {"reason": f"rollout {run.rollout.id} rolled back"}
    else:
        type_, args = "cancel", {"job_id": e.id.rsplit(".cancel", 1)[0]}
    # expires_at = the controller's own deadline: a command that waits in an offline
    # device's session past it is EXPIRED there, not started after we gave up on it.
    cmd = Command(
        id=e.id, type=type_, issued_at=sent,  # type: ignore[arg-type]
        expires_at=datetime.fromtimestamp((e.sent_at or 0) + p.timeout_s, timezone.utc),
        timeout_s=p.timeout_s, args=args,
    )
    return topics.command(e.device, type_), cmd.to_payload()


def finish_execution(run: RolloutRun, e: Execution, status: str, r: Result, now: float) -> None:
    """A terminal result lands on its execution: status, error, result and, for a job that
    succeeded, its JobOutcome's outcome and the abort metric before and after."""
    e.status, e.finished_at = status, now
    e.error_code = r.error.code if r.error else None
    e.error_message = r.error.message if r.error else None
    e.result = r.result
    if status == "SUCCEEDED" and r.result is not None and e.kind == "job":
        try:
            out = JobOutcome.model_validate(r.result)
        except ValidationError:
            out = None
        if out is not None:
            e.outcome = out.outcome
            m = run.plan.abort_metric
            if m:
                m = abort_metric_of(m, out.gate_metric)
                e.metric_before = out.metrics_before.get(m)
                e.metric_after = out.metrics_after.get(m)
    log.debug("execution finished", extra={
        "exec": e.id, "status": status, "outcome": e.outcome, "code": e.error_code})


def infer_status(r: Result) -> str | None:
    """Where a DUPLICATE's command stands when the device did not say (older agents)."""
    if r.result is not None:
        return "SUCCEEDED"
    if r.error is not None:
        code = r.error.code
        return code if code in ("CANCELED", "TIMED_OUT", "EXPIRED") else "FAILED"
    return None
