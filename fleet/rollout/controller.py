"""The rollout controller: waves, rate limit, timeouts, retries, health gates, abort, rollback.

A loop over (messages in → state → sends out), every change in the store before anything is
published. Execution ids are ``{rollout}-{nonce}.{device}.{attempt}``: a restarted controller
re-sends the same id for every execution that was open, and a device that already has it
answers DUPLICATE with where it stands — so no device ever runs one execution twice.

Rollout states: running → (paused ⇄ running; waiting_approval → running before a wave an
operator must approve) → succeeded (every wave done, every device succeeded) or
completed_with_failures (every wave done, some device failed for good without reaching the
abort threshold), or → aborting → rolling_back → aborted; ``rollback`` of a finished
rollout: rolling_back → rolled_back.

Execution ids, the in-memory ``RolloutRun`` and the summaries read from it are in
``fleet.rollout.run``; the command sent for an execution and how a result lands on it, in
``fleet.rollout.messages``. The decisions this loop acts on are each in a module named for
them: when a rollout aborts itself and what follows (``fleet.rollout.abort``), when a wave is
finished and how a rollout ends (``fleet.rollout.verdict``), whether an ended execution runs
again (``fleet.rollout.retry``); the operator's controls: the send rate, wave approvals and
which wave a joining device goes into (``fleet.rollout.controls``), acted on in
``fleet.rollout.operated``. The loop that drives it all is ``fleet.rollout.loop``.

A device that answers DEFERRED (busy fine-tuning, throttled) keeps its execution open: the
same id goes again at its recheck time, no attempt and no failure counted, at most the
plan's ``max_defers`` times (then FAILED, ``DEFERRED_TOO_OFTEN``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from contract import Result
from fleet.inventory import Inventory
from fleet.mqtt import FleetConnection
from fleet.rollout import controls
from fleet.rollout.abort import abort_on_failure_rate, abort_on_metric_drop, state_after_abort
from fleet.rollout.loop import ControllerLoop
from fleet.rollout.messages import command_for, finish_execution, infer_status
from fleet.rollout.operated import OperatorControls
from fleet.rollout.replicas import Replica
from fleet.rollout.run import DEVICE_TERMINAL, RolloutRun, exec_id
from fleet.rollout.schedule import Schedule
from fleet.rollout.store import (
    ROLLOUT_GOING,
    Execution,
    FleetStore,
)
from fleet.rollout.verdict import rollback_verdict, rollout_verdict, wave_baked, wave_finished

log = logging.getLogger("fleet.controller")

CONTROLLER_TIMEOUT = "CONTROLLER_TIMEOUT"
"""error_code of an execution the controller gave up on (no terminal result in timeout_s);
the device's own late result may still overrule it."""


class Controller(ControllerLoop, OperatorControls):
    def __init__(
        self,
        store: FleetStore,
        conn: FleetConnection,
        *,
        on_progress: Callable[[RolloutRun], None] | None = None,
        replica: Replica | None = None,
        reask_s: float = 30.0,
        membership: Mapping[str, list[str]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.clock = clock
        """Every time the controller records and decides by (a test runs it faster)."""
        self.inventory = Inventory(membership)
        """Group membership as the statuses (or the operator's inventory) say: who joins a
        ``follow_group`` rollout."""
        self.replica = replica
        """Set when this is one of several controllers on a PostgreSQL db
        (``fleet.rollout.replicas``): it drives only the rollouts whose lease it holds."""
        self.conn = conn
        self.topics = conn.topics
        self.runs: dict[str, RolloutRun] = {}
        self.sched: dict[str, Schedule] = {}
        """Per rollout: what is due when, so a turn costs what changed, not the fleet size."""
        self.by_exec: dict[str, RolloutRun] = {}
        self.dirty: dict[str, Execution] = {}
        self.outbox: list[tuple[RolloutRun, Execution]] = []
        self.on_progress = on_progress
        self._drained: list[int] = []
        self.reask_s = reask_s
        """An open execution nothing was heard of for this long is sent again (same id): the
        device answers DUPLICATE with where it stands. What recovers a result that reached no
        one (a replica killed with it unwritten, a broker restarted without persistence)."""
        self.heard: dict[str, float] = {}
        self.asked: dict[str, int] = {}

    # --- loading and resuming ---------------------------------------------------------

    def take(self, rid: str) -> bool:
        """Drive ``rid`` from now on (a replica: once its lease is ours). True when driven."""
        if rid in self.runs:
            return True
        if self.replica is not None and not self.replica.acquire(rid):
            return False
        self.load(rid)
        return True

    def drop(self, rid: str) -> None:
        """Stop driving ``rid`` (its lease went to another replica): forget it, unsent."""
        run = self.runs.pop(rid, None)
        self.sched.pop(rid, None)
        if run is None:
            return
        for eid in run.execs:
            self.by_exec.pop(eid, None)
            self.dirty.pop(eid, None)
        self.outbox = [(r, e) for r, e in self.outbox if r is not run]
        log.warning("rollout dropped: its lease is another replica's", extra={"rollout": rid})

    def load(self, rid: str) -> RolloutRun:
        r = self.store.rollout(rid)
        if r is None:
            raise KeyError(f"no rollout {rid!r}")
        run = RolloutRun(r, self.store.waves(rid), self.store.targets(rid))
        sched = self.sched[rid] = Schedule()
        now = self.clock()
        for e in self.store.executions(rid):
            run.add(e)
            self.by_exec[e.id] = run
            if e.status == "PLANNED":
                sched.plan(e)
            elif e.status == "DEFERRED":
                sched.recheck(e)
            if e.sent_at is not None:
                if e.kind == "job":
                    run.notified.add(e.device)
                if now - e.sent_at <= 60:  # the rate's window goes on where it was
                    run.sends.append(e.sent_at)
        run.sends = type(run.sends)(sorted(run.sends))
        self.runs[rid] = run
        # Re-send every execution that was in flight with its original id and times: the
        # device answers DUPLICATE (it has it) or runs it (it never arrived) — never twice.
        for e in run.execs.values():
            if e.open and e.status not in ("PLANNED", "DEFERRED"):
                sched.sent(e, run.plan.timeout_s, self.reask_s)
                self.outbox.append((run, e))
        self._retries(run, list(run.latest().values()))
        log.info("rollout loaded", extra={"rollout": rid, "state": r.state,
                                           "resent": len(self.outbox)})
        return run

    # --- messages in ------------------------------------------------------------------

    def on_result(self, device: str, r: Result) -> None:
        """One result from ``device``: the id in its topic (see fleet.mqtt.device_message)."""
        run = self.by_exec.get(r.id)
        if run is None:
            # Another sender's command (fleetctl send), or a rollout another replica drives:
            # to the inbox, where its holder finds it (a stranger's id is dropped there).
            if self.replica is not None:
                self.replica.defer(device, r)
            return
        e = run.execs[r.id]
        if device != e.device:
            # Execution ids are guessable: a device may answer for another's execution.
            log.warning("result from the wrong device ignored",
                        extra={"exec": e.id, "device": device})
            return
        status: str | None = r.status
        if status == "DUPLICATE":
            status = r.stored_status or infer_status(r)
            if status in (None, "DUPLICATE"):
                return
        now = self.clock()
        self.heard[e.id] = now
        if status == "DEFERRED":
            if e.status != "SENT":
                return  # a late copy: the execution already moved on
            self._deferred(run, e, r, now)
        elif status == "ACCEPTED":
            if e.status == "SENT":
                e.status = "ACCEPTED"
        elif status == "IN_PROGRESS":
            if e.open:
                e.status, e.started_at = "IN_PROGRESS", e.started_at or now
        elif status in DEVICE_TERMINAL:
            # A late result may still overrule our own timeout: the device's word on whether
            # the model changed is what a rollback needs.
            if not e.open and e.error_code != CONTROLLER_TIMEOUT:
                return
            finish_execution(run, e, status, r, now)
        self.dirty[e.id] = e
        self.sched[run.rollout.id].changed = True

    # --- sending ----------------------------------------------------------------------

    def _plan_exec(self, run: RolloutRun, device: str, wave: int, attempt: int,
                   kind: str = "job") -> Execution:
        e = Execution(exec_id(run.rollout, device, attempt, kind), run.rollout.id, device,
                      wave, kind, attempt, "PLANNED", self.clock())
        run.add(e)
        self.by_exec[e.id] = run
        self.dirty[e.id] = e
        sched = self.sched[run.rollout.id]
        sched.plan(e)
        sched.changed = True
        return e

    def _queue_send(self, run: RolloutRun, e: Execution, now: float) -> None:
        e.status, e.sent_at = "SENT", now
        self.dirty[e.id] = e
        self.outbox.append((run, e))
        run.sends.append(now)
        if e.kind == "job":
            run.notified.add(e.device)
        self.sched[run.rollout.id].sent(e, run.plan.timeout_s, self.reask_s)

    def _cancel(self, run: RolloutRun, e: Execution, now: float) -> None:
        cid = e.id + ".cancel"
        if cid in run.execs:
            return
        c = Execution(cid, run.rollout.id, e.device, e.wave, "cancel", e.attempt, "PLANNED", now)
        run.add(c)
        self.by_exec[cid] = run
        self._queue_send(run, c, now)

    def flush(self) -> None:
        """Persist this turn's changes, then publish: a send is durable before it leaves."""
        if self.dirty:
            owner = self.replica.owner if self.replica is not None else ""
            self.store.save_executions(self.dirty.values(), owner)
            self.dirty.clear()
        if self.replica is not None:
            self.replica.flush()
            self.replica.applied(self._drained)
            self._drained = []
        for run, e in self.outbox:
            topic, payload = command_for(self.topics, run, e)
            self.conn.publish(topic, payload)
        self.outbox.clear()

    # --- the state machine ----------------------------------------------------------------

    def tick(self, run: RolloutRun, now: float) -> None:
        req = self.store.take_request(run.rollout.id)
        if req:
            self._apply_request(run, req, now)
        self._timeouts(run, now)
        state = run.rollout.state
        if state in ROLLOUT_GOING:
            rid = run.rollout.id
            self._resend_deferred(run, now)
            self._retries(run, [e for e in self.dirty.values()
                                if e.rollout_id == rid and e.kind == "job"])
            census = self.sched[rid].census(run, now)
            reason = abort_on_failure_rate(run.plan, census)
            if reason is not None:
                self.abort(run, reason, now)
            else:
                self._rate(run, census.succeeded, now)
                self._waves(run, now)
        elif state == "aborting":
            self._aborting(run, now)
        elif state == "rolling_back":
            self._rolling_back(run, now)

    def _set_state(self, run: RolloutRun, state: str, reason: str | None = None) -> None:
        self.store.set_rollout_state(run.rollout.id, state, reason)
        run.rollout.state = state
        if reason:
            run.rollout.reason = reason
        self.sched[run.rollout.id].counted = None  # what is final depends on the state
        log.info("rollout state", extra={"rollout": run.rollout.id, "state": state,
                                          "reason": reason})

    def _apply_request(self, run: RolloutRun, req: str, now: float) -> None:
        state = run.rollout.state
        req, _, arg = req.partition(":")
        if req == "approve" and state in ROLLOUT_GOING:
            self._approve(run, int(arg or 0))
        elif req == "pause" and state in ("running", "waiting_approval"):
            self._set_state(run, "paused")
        elif req == "resume" and state == "paused":
            self._set_state(run, "running")
        elif req == "abort" and state in ROLLOUT_GOING:
            self.abort(run, "operator abort", now)
        elif req == "rollback" and state in ROLLOUT_GOING:
            # (A finished rollout is reopened by `fleetctl rollout rollback` itself.)
            self.abort(run, "operator rollback", now, rollback=True)

    def abort(self, run: RolloutRun, reason: str, now: float, rollback: bool | None = None) -> None:
        """Stop new waves, drop what was not sent, cancel what waits on a device, let
        running executions finish; then roll back (if the plan says so)."""
        for w in run.waves:
            if w.state in ("running", "baking"):
                w.state, w.finished_at = "aborted", now
                self.store.save_wave(w)
        for e in list(run.execs.values()):
            if e.status in ("PLANNED", "DEFERRED"):
                e.status, e.finished_at = "CANCELED", now
                e.error_code, e.error_message = "ABORTED", "never sent: the rollout was aborted"
                self.dirty[e.id] = e
            elif e.kind == "job" and e.status in ("SENT", "ACCEPTED"):
                self._cancel(run, e, now)
        if rollback is not None and rollback != run.plan.rollback_on_abort:
            run.rollout.plan = run.plan.model_copy(update={"rollback_on_abort": rollback})
            self.store.save_plan(run.rollout.id, run.rollout.plan)
        self._set_state(run, "aborting", reason)

    def _timeouts(self, run: RolloutRun, now: float) -> None:
        sched = self.sched[run.rollout.id]
        for eid in sched.due(sched.deadlines, now):
            e = run.execs[eid]
            if (e.open and e.status != "DEFERRED" and e.sent_at is not None
                    and now - e.sent_at > run.plan.timeout_s):
                sched.changed = True
                was_started = e.status in ("ACCEPTED", "IN_PROGRESS")
                e.status, e.finished_at = "TIMED_OUT", now
                e.error_code = CONTROLLER_TIMEOUT
                e.error_message = f"no terminal result within {run.plan.timeout_s:g} s"
                self.dirty[e.id] = e
                if was_started and e.kind == "job":
                    self._cancel(run, e, now)  # so a retry never runs beside the old one
        for eid in sched.due(sched.asks, now):
            e = run.execs[eid]
            if not e.open or e.sent_at is None or e.status in ("PLANNED", "DEFERRED"):
                continue
            # Twice as long each time: an offline device's queue gets a few copies (its agent
            # answers the later ones DUPLICATE), a long job a few questions, not one a period.
            at = max(e.sent_at, self.heard.get(e.id, 0.0)) + \
                self.reask_s * 2 ** self.asked.get(e.id, 0)
            if at <= now:
                self.heard[e.id] = now
                self.asked[e.id] = self.asked.get(e.id, 0) + 1
                self.outbox.append((run, e))
                at = now + self.reask_s * 2 ** self.asked[e.id]
            sched.ask_later(at, eid)

    def _retries(self, run: RolloutRun, changed: list[Execution]) -> None:
        """A retry for each of ``changed`` that ended as the latest attempt of its device
        with attempts left (a turn passes what changed in it; a load, every device)."""
        latest = run.latest()
        for e in changed:
            if latest.get(e.device) is e and not e.open and not run.final(e):
                self._plan_exec(run, e.device, e.wave, e.attempt + 1)

    def _waves(self, run: RolloutRun, now: float) -> None:
        wave = next((w for w in run.waves if w.state != "done"), None)
        if wave is None:
            # The verdict: counted now, not from a turn ago.
            self._set_state(run, rollout_verdict(run.census()))
            return
        if wave.state == "pending":
            if run.rollout.state == "paused":
                return
            if not controls.approved(run.plan, run.rollout.controls, wave.idx):
                if run.rollout.state != "waiting_approval":
                    self._set_state(run, "waiting_approval", None)
                    log.info("wave waits for approval", extra={
                        "rollout": run.rollout.id, "wave": wave.idx,
                        "next": f"fleetctl rollout approve {run.rollout.id}"})
                return
            wave.state, wave.started_at = "running", now
            self.store.save_wave(wave)
            have = run.latest()
            for dev, w in run.targets:
                if w == wave.idx and dev not in have:
                    self._plan_exec(run, dev, wave.idx, 1)
            log.info("wave started", extra={"rollout": run.rollout.id, "wave": wave.idx,
                                             "target": wave.target})
        if wave.state == "running":
            sched = self.sched[run.rollout.id]
            if run.rollout.state == "running":
                while sched.planned:
                    e = run.execs[sched.planned[0]]
                    if e.status == "PLANNED":
                        if not run.may_send(now):
                            break
                        self._queue_send(run, e, now)
                    sched.planned.popleft()
            if wave_finished(sched.census(run, now), wave.idx):
                mine = [e for e in run.latest().values() if e.wave == wave.idx]
                reason = abort_on_metric_drop(run.plan, wave.idx, mine)
                if reason is not None:
                    self.abort(run, reason, now)
                    return
                wave.state = "baking"
                wave.bake_until = now + run.plan.bake_s
                self.store.save_wave(wave)
        if wave_baked(wave, now):
            wave.state, wave.finished_at = "done", now
            self.store.save_wave(wave)
            log.info("wave done", extra={"rollout": run.rollout.id, "wave": wave.idx})

    def _aborting(self, run: RolloutRun, now: float) -> None:
        if self.sched[run.rollout.id].census(run, now).open_jobs:
            return  # running executions finish; their outcome decides their rollback
        self._set_state(run, state_after_abort(run.plan))

    def committed_devices(self, run: RolloutRun) -> list[str]:
        return sorted({e.device for e in run.execs.values()
                       if e.kind == "job" and e.status == "SUCCEEDED" and e.outcome == "committed"})

    def _rolling_back(self, run: RolloutRun, now: float) -> None:
        rbs = run.latest("rollback")
        for dev in self.committed_devices(run):
            if dev not in rbs:
                w = next((e.wave for e in run.execs.values() if e.device == dev), -1)
                self._queue_send(run, self._plan_exec(run, dev, w, 1, "rollback"), now)
        if any(e.open for e in run.latest("rollback").values()):
            return
        self._set_state(run, rollback_verdict(run.rollout))
