"""What the controller does for the operator's controls (``fleet.rollout.controls`` decides,
this acts): a device's DEFERRED answer and the re-send at its recheck time, a device that
joined a ``follow_group`` rollout's group, the send rate's growth, and a wave approval. Each
records its change in the store (through the controller's turn) before anything it allows is
sent. ``OperatorControls`` is a part of ``fleet.rollout.controller.Controller``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from contract import Result, Status
from fleet.inventory import Inventory
from fleet.rollout import controls
from fleet.rollout.run import RolloutRun
from fleet.rollout.schedule import Schedule
from fleet.rollout.store import DEFERRED_TOO_OFTEN, ROLLOUT_GOING, Execution, FleetStore

log = logging.getLogger("fleet.controller")  # runs inside the controller's loop


class OperatorControls:
    """The controller's acts for the rollout controls (mixed into ``Controller``)."""

    store: FleetStore
    runs: dict[str, RolloutRun]
    sched: dict[str, Schedule]
    dirty: dict[str, Execution]
    outbox: list[tuple[RolloutRun, Execution]]
    inventory: Inventory
    reask_s: float
    clock: Callable[[], float]
    _plan_exec: Callable[..., Execution]
    _set_state: Callable[..., None]

    def _deferred(self, run: RolloutRun, e: Execution, r: Result, now: float) -> None:
        """The device put ``e`` off: send the same id again at its recheck time, or fail it
        once it was put off more than ``max_defers`` times."""
        e.defers += 1
        why = r.error.message if r.error else "busy"
        if e.defers > run.plan.max_defers:
            e.status, e.finished_at = "FAILED", now
            e.error_code = DEFERRED_TOO_OFTEN
            e.error_message = (f"the device deferred it {e.defers} times (max_defers "
                               f"{run.plan.max_defers}); last: {why}")
            return
        e.status = "DEFERRED"
        e.recheck_at = now + float(r.recheck_after_s or 1.0)
        self.sched[run.rollout.id].recheck(e)
        log.info("execution deferred", extra={"exec": e.id, "defers": e.defers,
                                              "recheck_at": e.recheck_at, "why": why})

    def on_status(self, device: str, st: Status | None) -> None:
        """A device's status: a device that joined the group of a ``follow_group`` rollout
        that goes on is added to it (``fleet.rollout.controls.wave_for_joiner``)."""
        if self.inventory.update(device, st) is None:
            return
        groups = self.inventory.groups_of(device)
        now = self.clock()
        for run in self.runs.values():
            p = run.plan
            if (p.follow_group and p.group in groups and run.rollout.state in ROLLOUT_GOING
                    and device not in run.target_set()):
                self._join(run, device, now)

    def _join(self, run: RolloutRun, device: str, now: float) -> None:
        idx = controls.wave_for_joiner(run.waves)
        self.store.add_target(run.rollout.id, device, idx)
        run.add_target(device, idx)
        wave = run.waves[idx]
        if wave.state in ("running", "baking", "done"):
            # The last wave started: the joiner runs in it now (a wave that was baking or had
            # just finished runs again until the joiner is done too).
            if wave.state != "running":
                wave.state, wave.finished_at, wave.bake_until = "running", None, None
                self.store.save_wave(wave)
            self._plan_exec(run, device, idx, 1)
        log.info("device joined the rollout's group", extra={
            "rollout": run.rollout.id, "device": device, "wave": idx})

    def _resend_deferred(self, run: RolloutRun, now: float) -> None:
        """Each DEFERRED execution whose recheck time came goes again with its own id (not
        through the rate: its device was notified already)."""
        sched = self.sched[run.rollout.id]
        for eid in sched.due(sched.rechecks, now):
            e = run.execs[eid]
            if e.status != "DEFERRED":
                continue
            e.status, e.sent_at, e.recheck_at = "SENT", now, None
            self.dirty[e.id] = e
            self.outbox.append((run, e))
            sched.sent(e, run.plan.timeout_s, self.reask_s)

    def _rate(self, run: RolloutRun, succeeded: int, now: float) -> None:
        """Record the starting rate, or grow it (``fleet.rollout.controls.next_rate``)."""
        change = controls.next_rate(run.plan, run.rollout.controls,
                                    {"notified": len(run.notified), "succeeded": succeeded}, now)
        if change is None:
            return
        grew = "rate" in run.rollout.controls
        run.rollout.controls.update(change)
        self.store.save_controls(run.rollout.id, run.rollout.controls)
        if grew:
            log.info("rollout rate increased", extra={
                "rollout": run.rollout.id, "per_minute": controls.rate_limit(
                    run.plan, run.rollout.controls), "mark": change["rate_mark"]})

    def _approve(self, run: RolloutRun, wave: int) -> None:
        """An operator approved the waves up to ``wave``: recorded before any of them starts;
        a rollout that waited goes on (``_waves`` starts the wave once it is approved)."""
        c = run.rollout.controls
        c["approved"] = max(int(c.get("approved", 0)), wave)
        self.store.save_controls(run.rollout.id, c)
        log.info("waves approved", extra={"rollout": run.rollout.id, "through": c["approved"]})
        if run.rollout.state == "waiting_approval":
            self._set_state(run, "running")
