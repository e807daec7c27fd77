"""What the dashboard shows of the state db, read on its own connection: each rollout's waves,
failures with their reasons and controls (the same ``summarize`` as ``fleetctl rollout
status``), fleet-learning rounds with their accuracy per round (as ``fleetctl learn status``),
and which device runs which rollout's job now.

Reads only, and cheaply: a one-query fingerprint per tick (counts and latest times of each
shown rollout's executions) says which rollouts changed; only those are read again (of
their executions, only the rows that changed are built again), and a
rollout whose read takes long is read at most every ``COST_FACTOR`` times its read time, so a
10,000-device rollout costs the controller's host a bounded share of a core, however often
the page asks. Shown: every active rollout and the :data:`MAX_ROLLOUTS` latest ones.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.learn.report import round_summary
from fleet.learn.store import LearnStore
from fleet.rollout import report as rollout_reports
from fleet.rollout.run import summarize
from fleet.rollout.store import ROLLOUT_ACTIVE, FleetStore

MAX_ROLLOUTS = 20
"""Finished rollouts shown beside the active ones (the latest first)."""
MAX_ACTIVE = 200
"""Rollouts shown at most, active ones included."""
MAX_LEARNS = 10
MAX_FAILURES = 20
"""Failed devices listed per rollout (the count says how many more)."""
COST_FACTOR = 8.0
"""A rollout is read whole at most every ``COST_FACTOR`` x the CPU its last read took (up to
:data:`MAX_PERIOD_S`): the reads take 1/8 of a core at most for a rollout of up to ~10,000
devices (a read of 10,000 executions: ~70 ms)."""
MIN_PERIOD_S = 0.25
MAX_PERIOD_S = 0.6
"""A changing rollout is read again within this, whatever its read costs: the page stays
under a second behind the controller. A change of its state or request is read at once."""


@dataclass
class _Cached:
    fingerprint: tuple[Any, ...]
    summary: dict[str, Any]
    running: dict[str, str]
    """device -> what it runs for this rollout (open executions already sent)."""
    failed: dict[str, str]
    read_at: float
    took_s: float


class FleetReader:
    """The state db ``db`` as the page shows it; one thread calls :meth:`read`."""

    def __init__(self, db: str | Path) -> None:
        self.store = FleetStore(db)
        self.learns = LearnStore(self.store)
        self._rollouts: dict[str, _Cached] = {}
        self._runs: dict[str, rollout_reports.RunCache] = {}
        """What each shown rollout's last read keeps for the next (``load_run``'s cache)."""
        self._learns_key: Any = None
        self._learns: list[dict[str, Any]] = []

    def close(self) -> None:
        self.store.close()

    def read(self) -> dict[str, Any]:
        """``rollouts`` (id -> summary, ``order``: newest first), ``learns``, and the
        devices' rollout facts (``running``: device -> job, ``failed``: device -> reason;
        ``devices_key`` changes when they may have)."""
        db = self.store.db
        now = time.monotonic()
        rows = db.execute(
            "SELECT id, state, reason, request, updated_at, finished_at, controls FROM rollouts "
            "ORDER BY created_at DESC").fetchall()
        recent = {r[0] for r in [x for x in rows if x[1] not in ROLLOUT_ACTIVE][:MAX_ROLLOUTS]}
        shown = [r for r in rows if r[1] in ROLLOUT_ACTIVE or r[0] in recent][:MAX_ACTIVE]
        ids = [str(r[0]) for r in shown]
        agg: dict[str, tuple[Any, ...]] = {}
        if ids:
            marks = ", ".join(f":r{i}" for i in range(len(ids)))
            for row in db.execute(
                    "SELECT rollout_id, COUNT(*), COUNT(sent_at), COUNT(started_at), "
                    "COUNT(finished_at), MAX(COALESCE(finished_at, started_at, sent_at, "
                    "created_at)), SUM(defers), SUM(CASE WHEN status = 'SUCCEEDED' THEN 1 "
                    "ELSE 0 END) FROM executions WHERE rollout_id IN "
                    f"({marks}) GROUP BY rollout_id", {f"r{i}": x for i, x in enumerate(ids)}):
                agg[str(row[0])] = tuple(row[1:])
        for r in shown:
            rid = str(r[0])
            fp = (*r[1:], *agg.get(rid, ()))
            old = self._rollouts.get(rid)
            if old is not None and (old.fingerprint == fp or (
                    old.fingerprint[:6] == fp[:6]  # its state and request are as read
                    and now - old.read_at < min(MAX_PERIOD_S, max(
                        MIN_PERIOD_S, COST_FACTOR * old.took_s)))):
                continue
            self._rollouts[rid] = self._read_rollout(rid, fp, now)
        for rid in set(self._rollouts) - set(ids):
            del self._rollouts[rid]
            self._runs.pop(rid, None)
        running: dict[str, str] = {}
        failed: dict[str, str] = {}
        for rid in reversed(ids):  # the newest rollout's word last: it wins
            c = self._rollouts[rid]
            running.update(c.running)
            failed.update(c.failed)
            for dev in c.running:
                failed.pop(dev, None)
        # Changes when any shown rollout was read again: what the device table depends on.
        devices_key = tuple((rid, self._rollouts[rid].read_at) for rid in ids)
        return {"rollouts": {rid: self._rollouts[rid].summary for rid in ids}, "order": ids,
                "learns": self._read_learns(), "running": running, "failed": failed,
                "devices_key": devices_key}

    def _read_rollout(self, rid: str, fp: tuple[Any, ...], now: float) -> _Cached:
        t0 = time.thread_time()  # CPU, not wall: a busy host must not stretch the period
        run = rollout_reports.load_run(self.store, rid,
                                       self._runs.setdefault(rid, rollout_reports.RunCache()))
        s = summarize(run)
        plan = run.plan
        waiting = (next((w["wave"] for w in s["waves"] if w["state"] == "pending"), None)
                   if s["state"] == "waiting_approval" else None)
        fails = s["failures"]
        summary = {
            "id": rid, "state": s["state"], "reason": s["reason"],
            "request": run.rollout.request, "job": plan.job,
            "group": plan.group or f"{len(plan.devices or [])} devices",
            "approve_waves": plan.approve_waves, "waiting_wave": waiting,
            "approved_wave": s["approved_wave"], "rate_per_minute": s["rate_per_minute"],
            "targets": s["targets"], "rolled_back": s["rolled_back"],
            "created_at": run.rollout.created_at, "finished_at": run.rollout.finished_at,
            "waves": [{k: w[k] for k in ("wave", "state", "devices", "sent", "running",
                                         "deferred", "succeeded", "failed", "canceled")}
                      for w in s["waves"]],
            "failed_total": len(fails),
            "failures": [{"device": f["device"], "wave": f["wave"], "status": f["status"],
                          "code": f["code"],
                          "message": " ".join(str(f["message"] or "").split())[:200] or None}
                         for f in fails[:MAX_FAILURES]],
        }
        running = {e.device: f"{plan.job} ({rid}, {e.status.lower()})"
                   for e in run.latest().values() if e.open and e.sent_at is not None}
        failed = {f["device"]: f"{rid}: {f['code'] or f['status']}" for f in fails}
        took = time.thread_time() - t0
        return _Cached(fp, summary, running, failed, now, took)

    def _read_learns(self) -> list[dict[str, Any]]:
        db = self.store.db
        key = db.execute("SELECT COUNT(*), MAX(updated_at) FROM learn_rounds").fetchone()
        key = (tuple(key), tuple(db.execute(
            "SELECT COUNT(*), MAX(updated_at) FROM learns").fetchone()))
        if key == self._learns_key:
            return self._learns
        out = []
        for learn in self.learns.learns()[-MAX_LEARNS:][::-1]:
            curve = []
            for rs in self.learns.rounds(learn.id):
                ev = round_summary(rs)["evaluation"]
                curve.append({"round": rs.round, "phase": rs.phase, "outcome": rs.outcome,
                              "base": ev.get("base_accuracy"),
                              "candidate": ev.get("candidate_accuracy"),
                              "personalized": ev.get("personalized_accuracy"),
                              "release": rs.release, "reason": rs.reason})
            out.append({"id": learn.id, "state": learn.state, "reason": learn.reason,
                        "round": learn.round, "rounds": learn.plan.rounds, "base": learn.base,
                        "model": learn.plan.model, "curve": curve})
        self._learns_key, self._learns = key, out
        return out


def compact(obj: Any) -> str:
    """The JSON of one event: no spaces (the SSE stream's bytes are the page's cost)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, default=str)
