"""One rollout as the controller and its readers see it: ``RolloutRun`` (the rollout, its
waves, its target snapshot and every execution, cached from the store), the execution ids
(``exec_id``), which device statuses count as failed or final, and ``summarize`` /
``failures``: the per-wave counts and failed devices that ``rollout status``, the progress bars
and the report show.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fleet.rollout.controls import rate_limit
from fleet.rollout.plan import RolloutPlan
from fleet.rollout.retry import will_retry
from fleet.rollout.store import Execution, Rollout, Wave

DEVICE_TERMINAL = frozenset(
    {"SUCCEEDED", "FAILED", "TIMED_OUT", "EXPIRED", "REJECTED", "CANCELED"}
)


def exec_id(rollout: Rollout, device: str, attempt: int, kind: str = "job") -> str:
    """``{rollout}-{nonce}.{device}.{attempt}``: the same on every restart of this rollout,
    never the same for another one."""
    key = f"{rollout.id}-{rollout.nonce}"
    return f"{key}.{device}.{attempt}" if kind == "job" else f"{key}.{device}.{kind}{attempt}"


@dataclass
class Census:
    """What the controller's decisions read of a rollout's latest job attempts, counted in
    one pass (``census``): the failure rate's figures, each wave's unfinished devices, and
    whether any job still runs."""

    done: int = 0
    """Final and not CANCELED."""
    failed: int = 0
    """Of ``done``, failed."""
    failed_any: int = 0
    """Failed among all latest attempts (the finished rollout's verdict)."""
    unfinished: dict[int, int] = field(default_factory=dict)
    """Per wave: devices whose latest attempt is not final."""
    devices: dict[int, int] = field(default_factory=dict)
    """Per wave: devices with an attempt."""
    open_jobs: bool = False
    succeeded: int = 0
    """Latest attempts that succeeded (and were not rolled back by the device's gates)."""
    took_s: float = 0.0


@dataclass
class RolloutRun:
    """One rollout's state in memory; the store is the truth, this is its cache."""

    rollout: Rollout
    waves: list[Wave]
    targets: list[tuple[str, int]]
    execs: dict[str, Execution] = field(default_factory=dict)
    sends: deque[float] = field(default_factory=deque)
    """When each command of the last 60 s went out (the rate's window)."""
    notified: set[str] = field(default_factory=set)
    """Devices sent the job at least once (the rate's ``notified`` trigger)."""
    _latest: dict[str, dict[str, Execution]] | None = field(default=None, repr=False)
    _targeted: set[str] | None = field(default=None, repr=False)

    @property
    def plan(self) -> RolloutPlan:
        return self.rollout.plan

    def target_set(self) -> set[str]:
        """The targeted devices (cached; ``add_target`` keeps it current)."""
        if self._targeted is None:
            self._targeted = {d for d, _ in self.targets}
        return self._targeted

    def add_target(self, device: str, wave: int) -> None:
        """A device that joined the group (already in the store): one more in ``wave`` and
        in the cumulative targets of the waves from it on."""
        self.targets.append((device, wave))
        self.target_set().add(device)
        for w in self.waves:
            if w.idx >= wave:
                w.target += 1

    def add(self, e: Execution) -> None:
        """A new execution (the only way one is added: the latest-attempt index follows)."""
        self.execs[e.id] = e
        if self._latest is not None:
            cur = self._latest.setdefault(e.kind, {})
            old = cur.get(e.device)
            if old is None or e.attempt > old.attempt:
                cur[e.device] = e

    def latest(self, kind: str = "job") -> dict[str, Execution]:
        """The last attempt per device (kept up to date by ``add``; read only)."""
        if self._latest is None:
            self._latest = {}
            for e in self.execs.values():
                cur = self._latest.setdefault(e.kind, {})
                if e.device not in cur or e.attempt > cur[e.device].attempt:
                    cur[e.device] = e
        return self._latest.get(kind, {})

    def census(self) -> Census:
        t0 = time.perf_counter()
        c = Census()
        for e in self.latest().values():
            final = self.final(e)
            failed = self.failed(e)
            c.devices[e.wave] = c.devices.get(e.wave, 0) + 1
            if final:
                if e.status != "CANCELED":
                    c.done += 1
                    c.failed += failed
            else:
                c.unfinished[e.wave] = c.unfinished.get(e.wave, 0) + 1
            c.failed_any += failed
            c.succeeded += e.status == "SUCCEEDED" and not failed
            c.open_jobs = c.open_jobs or e.open
        c.took_s = time.perf_counter() - t0
        return c

    def may_send(self, now: float) -> bool:
        """Under the rollout's rate now (sends of the last 60 s; ``fleet.rollout.controls``:
        the plan's ``max_per_minute``, grown by ``rate_increase``)."""
        limit = rate_limit(self.plan, self.rollout.controls)
        if limit is None:
            return True
        while self.sends and now - self.sends[0] > 60:
            self.sends.popleft()
        return len(self.sends) < limit

    def failed(self, e: Execution) -> bool:
        return e.status in DEVICE_TERMINAL - {"SUCCEEDED", "CANCELED"} or (
            e.status == "SUCCEEDED" and e.outcome == "rolled_back"
        )

    def final(self, e: Execution) -> bool:
        """Terminal and not to be retried (``fleet.rollout.retry``)."""
        if e.open:
            return False
        return not will_retry(self.plan, self.rollout.state, e)


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
            "running": sum(e.open and e.sent_at is not None and e.status != "DEFERRED"
                           for e in es),
            "deferred": sum(e.status == "DEFERRED" for e in es),
            "succeeded": sum(e.status == "SUCCEEDED" and not run.failed(e) for e in es),
            "failed": sum(run.failed(e) and run.final(e) for e in es),
            "canceled": sum(e.status == "CANCELED" for e in es),
            "started_at": w.started_at, "finished_at": w.finished_at,
        })
    rbs = run.latest("rollback").values()
    controls = run.rollout.controls
    return {
        "id": run.rollout.id, "state": run.rollout.state, "reason": run.rollout.reason,
        "rate_per_minute": rate_limit(run.plan, controls),
        "approved_wave": int(controls.get("approved", 0)) if run.plan.approve_waves else None,
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
