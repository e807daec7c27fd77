"""One rollout as the controller and its readers see it: ``RolloutRun`` (the rollout, its
waves, its target snapshot and every execution, cached from the store), the execution ids
(``exec_id``), which device statuses count as failed or final, and ``summarize`` /
``failures``: the per-wave counts and failed devices that ``rollout status``, the progress bars
and the report show.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fleet.plan import RolloutPlan
from fleet.store import Execution, Rollout, Wave

RETRIED = frozenset({"FAILED", "TIMED_OUT", "EXPIRED"})
"""Terminal statuses a plan's ``retries`` apply to; REJECTED never is (the args are wrong)."""
DEVICE_TERMINAL = frozenset(
    {"SUCCEEDED", "FAILED", "TIMED_OUT", "EXPIRED", "REJECTED", "CANCELED"}
)


def exec_id(rollout: Rollout, device: str, attempt: int, kind: str = "job") -> str:
    """``{rollout}-{nonce}.{device}.{attempt}``: the same on every restart of this rollout,
    never the same for another one."""
    key = f"{rollout.id}-{rollout.nonce}"
    return f"{key}.{device}.{attempt}" if kind == "job" else f"{key}.{device}.{kind}{attempt}"


@dataclass
class RolloutRun:
    """One rollout's state in memory; the store is the truth, this is its cache."""

    rollout: Rollout
    waves: list[Wave]
    targets: list[tuple[str, int]]
    execs: dict[str, Execution] = field(default_factory=dict)
    sends: deque[float] = field(default_factory=deque)

    @property
    def plan(self) -> RolloutPlan:
        return self.rollout.plan

    def latest(self, kind: str = "job") -> dict[str, Execution]:
        """The last attempt per device."""
        out: dict[str, Execution] = {}
        for e in self.execs.values():
            if e.kind == kind and (e.device not in out or e.attempt > out[e.device].attempt):
                out[e.device] = e
        return out

    def failed(self, e: Execution) -> bool:
        return e.status in DEVICE_TERMINAL - {"SUCCEEDED", "CANCELED"} or (
            e.status == "SUCCEEDED" and e.outcome == "rolled_back"
        )

    def final(self, e: Execution) -> bool:
        """Terminal and not to be retried."""
        if e.open:
            return False
        return not (
            e.status in RETRIED
            and e.attempt <= self.plan.retries
            and self.rollout.state in ("running", "paused")
        )


def summarize(run: RolloutRun) -> dict[str, Any]:
    """Counts per wave and overall, for the status table and the report."""
    latest = run.latest()
    waves = []
    for w in run.waves:
        devs = [d for d, wi in run.targets if wi == w.idx]
        es = [latest[d] for d in devs if d in latest]
        waves.append({
            "wave": w.idx, "state": w.state, "devices": len(devs),
            "sent": sum(e.sent_at is not None for e in es),
            "running": sum(e.open and e.sent_at is not None for e in es),
            "succeeded": sum(e.status == "SUCCEEDED" and not run.failed(e) for e in es),
            "failed": sum(run.failed(e) and run.final(e) for e in es),
            "canceled": sum(e.status == "CANCELED" for e in es),
            "started_at": w.started_at, "finished_at": w.finished_at,
        })
    rbs = run.latest("rollback").values()
    return {
        "id": run.rollout.id, "state": run.rollout.state, "reason": run.rollout.reason,
        "targets": len(run.targets), "waves": waves,
        "rolled_back": sum(e.status == "SUCCEEDED" for e in rbs),
        "rollback_failed": sum(not e.open and e.status != "SUCCEEDED" for e in rbs),
        "failures": failures(run),
    }


def failures(run: RolloutRun) -> list[dict[str, Any]]:
    """Each device whose last attempt failed for good (no retry left), with the device's
    reason: the error of its result, or our own CONTROLLER_TIMEOUT when it never answered in
    time, or (status ROLLED_BACK) why its own gates rolled the new model back."""
    out = []
    order = {d: i for i, (d, _) in enumerate(run.targets)}
    for e in sorted(run.latest().values(), key=lambda e: order.get(e.device, len(order))):
        if not (run.failed(e) and run.final(e)):
            continue
        status, code, message = e.status, e.error_code, e.error_message
        if e.status == "SUCCEEDED":  # outcome rolled_back: the device's gates said no
            status = "ROLLED_BACK"
            message = message or str((e.result or {}).get("reason") or "") or None
        out.append({"device": e.device, "wave": e.wave, "attempt": e.attempt,
                    "status": status, "code": code, "message": message,
                    "finished_at": e.finished_at})
    return out
