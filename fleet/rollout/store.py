"""The controller's durable state: rollouts, their waves and every execution, in SQLite (WAL;
one controller) or PostgreSQL (controller replicas), through ``fleet.db``. The same SQL and
the same tests run on both.

Written before anything is published, so a controller killed at any instant restarts from
here. Why SQLite's ``synchronous=NORMAL`` is enough: a process kill never loses a committed WAL
transaction, and even a power cut that loses the last ones is safe, because execution ids are
deterministic (rollout, device, attempt) — a re-planned execution gets the id the device has
already seen and is answered DUPLICATE instead of running twice.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.db import Database, IntegrityError
from fleet.rollout.plan import RolloutPlan

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    nonce TEXT NOT NULL,
    plan TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    request TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION,
    controls TEXT
);
CREATE TABLE IF NOT EXISTS waves (
    rollout_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    target INTEGER NOT NULL,
    state TEXT NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    bake_until DOUBLE PRECISION,
    PRIMARY KEY (rollout_id, idx)
);
CREATE TABLE IF NOT EXISTS targets (
    rollout_id TEXT NOT NULL,
    device TEXT NOT NULL,
    pos INTEGER NOT NULL,
    wave INTEGER NOT NULL,
    PRIMARY KEY (rollout_id, device)
);
CREATE TABLE IF NOT EXISTS executions (
    id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    device TEXT NOT NULL,
    wave INTEGER NOT NULL,
    kind TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    status TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    sent_at DOUBLE PRECISION,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    outcome TEXT,
    metric_before DOUBLE PRECISION,
    metric_after DOUBLE PRECISION,
    error_code TEXT,
    error_message TEXT,
    result TEXT,
    defers INTEGER NOT NULL DEFAULT 0,
    recheck_at DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS executions_rollout ON executions (rollout_id, kind, device);
CREATE TABLE IF NOT EXISTS fleet_schema (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    rollout_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS inbox (
    seq {serial} PRIMARY KEY,
    exec_id TEXT NOT NULL,
    device TEXT NOT NULL,
    body TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS inbox_exec ON inbox (exec_id);
"""
"""``leases`` and ``inbox``: what controller replicas share (``fleet.rollout.replicas``)."""

ROLLOUT_ACTIVE = ("running", "paused", "waiting_approval", "aborting", "rolling_back")
ROLLOUT_GOING = ("running", "paused", "waiting_approval")
"""Active and not winding down: the states whose waves go on (after a pause or an approval)
and which take pause, resume, abort and approve."""
ROLLOUT_FINAL = ("succeeded", "completed_with_failures", "aborted", "rolled_back")
"""``succeeded``: every wave done and every targeted device succeeded;
``completed_with_failures``: every wave done, but at least one device failed for good (the
failure rate stayed under the plan's abort threshold)."""
REQUESTS = ("pause", "resume", "abort", "rollback", "approve")
"""``approve`` is posted as ``approve:N``: waves up to N may start (``--approve-waves``)."""

EXEC_FAILED = ("FAILED", "TIMED_OUT", "EXPIRED", "REJECTED")
"""Terminal execution statuses that are failures (a SUCCEEDED whose outcome is rolled_back,
the device's own gates refusing the model, is one too)."""
SCHEMA_VERSION = 3
"""The row of ``fleet_schema`` (SQLite files written before it: ``PRAGMA user_version``).
1: a finished rollout with a failed device is ``completed_with_failures`` (version 0 called
it ``succeeded``). 2: the replicas' tables (``fleet.rollout.replicas``: leases, inbox).
3: the rollout controls (``rollouts.controls``: the current rate, approved waves) and device
deferrals (``executions.defers``, ``executions.recheck_at``)."""
_ADDED_COLUMNS = (
    ("rollouts", "controls", "TEXT"),
    ("executions", "defers", "INTEGER NOT NULL DEFAULT 0"),
    ("executions", "recheck_at", "DOUBLE PRECISION"),
)
"""Columns of version 3, added to a table an older version created."""
EXEC_OPEN = ("PLANNED", "SENT", "ACCEPTED", "IN_PROGRESS", "DEFERRED")
"""Controller-side execution states before the terminal ones of the contract; DEFERRED: the
device answered DEFERRED, the same id goes again at ``recheck_at``."""
DEFERRED_TOO_OFTEN = "DEFERRED_TOO_OFTEN"
"""error_code of an execution FAILED because its device deferred it more than the plan's
``max_defers`` times."""


@dataclass
class Execution:
    id: str
    rollout_id: str
    device: str
    wave: int
    kind: str
    """job | rollback | cancel"""
    attempt: int
    status: str
    created_at: float
    sent_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None
    metric_before: float | None = None
    metric_after: float | None = None
    error_code: str | None = None
    error_message: str | None = None
    result: dict[str, Any] | None = None
    defers: int = 0
    """DEFERRED answers so far (none counts as an attempt or a failure)."""
    recheck_at: float | None = None
    """While DEFERRED: when the same id is sent again."""

    @property
    def open(self) -> bool:
        return self.status in EXEC_OPEN

    def row(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _EXEC_FIELDS}
        out["result"] = None if self.result is None else json.dumps(self.result)
        return out

    @classmethod
    def from_row(cls, r: Any) -> Execution:
        e = cls(**dict(zip(_EXEC_FIELDS, r, strict=True)))
        e.result = None if e.result is None else json.loads(e.result)  # type: ignore[arg-type]
        e.defers = int(e.defers or 0)
        return e


_EXEC_FIELDS = (
    "id", "rollout_id", "device", "wave", "kind", "attempt", "status", "created_at", "sent_at",
    "started_at", "finished_at", "outcome", "metric_before", "metric_after", "error_code",
    "error_message", "result", "defers", "recheck_at",
)
_EXEC_COLS = ", ".join(_EXEC_FIELDS)
_EXEC_UPSERT = (
    f"INSERT INTO executions ({_EXEC_COLS}) VALUES ({', '.join(':' + f for f in _EXEC_FIELDS)}) "
    "ON CONFLICT (id) DO UPDATE SET "
    + ", ".join(f"{f} = excluded.{f}" for f in _EXEC_FIELDS[1:])
    # The fence: no update of a rollout another replica holds a live lease on. A replica that
    # stalled past its lease mid-turn (then flushes) cannot overwrite what the replica that
    # took the rollout over has written since.
    + " WHERE NOT EXISTS (SELECT 1 FROM leases l WHERE l.rollout_id = excluded.rollout_id "
    "AND l.owner <> :lease_owner AND l.expires_at > :lease_now)"
)


@dataclass
class Wave:
    rollout_id: str
    idx: int
    target: int
    """Cumulative device count reached at the end of this wave."""
    state: str
    """pending | running | baking | done | aborted"""
    started_at: float | None = None
    finished_at: float | None = None
    bake_until: float | None = None


@dataclass
class Rollout:
    id: str
    nonce: str
    """Random, fixed at creation, part of every execution id: a rollout of the same name in
    a fresh db never collides with ids the devices stored for an older one (which they would
    answer DUPLICATE, with the old result)."""
    plan: RolloutPlan
    state: str
    reason: str | None
    request: str | None
    created_at: float
    updated_at: float
    finished_at: float | None
    controls: dict[str, Any] = field(default_factory=dict)
    """What the controller decided that a restart must keep (``fleet.rollout.controls``):
    the current rate and when it last grew, the waves an operator approved."""


class FleetStore:
    """One connection per process; the controller writes, ``fleetctl rollout`` reads and
    posts operator requests (pause, resume, abort, rollback) that the controller applies.
    ``db``: a SQLite file path or a ``postgresql://`` URL."""

    def __init__(self, db: str | Path) -> None:
        self.db = Database(db)
        self.name = self.db.name
        with self.db.schema_lock():
            fresh = not self.db.has_table("rollouts")
            self.db.script(SCHEMA.replace("{serial}", self.db.serial))
            version = self.db.scalar("SELECT version FROM fleet_schema")
            if version is None:
                version = SCHEMA_VERSION if fresh else self.db.legacy_version()
                self.db.execute("INSERT INTO fleet_schema (version) VALUES (:v)", {"v": version})
            if version < 1:
                self._migrate_completed_with_failures()
            self._add_columns()
            # 1 -> 2 added tables only: SCHEMA above made them.
            if version < SCHEMA_VERSION:
                self.db.execute("UPDATE fleet_schema SET version = :v", {"v": SCHEMA_VERSION})

    def _add_columns(self) -> None:
        """Version 3's columns on tables an older version created (fresh ones have them)."""
        import sqlalchemy as sa

        for table, col, type_ in _ADDED_COLUMNS:
            have = {c["name"] for c in sa.inspect(self.db.conn).get_columns(table)}
            if col not in have:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {type_}")

    def _migrate_completed_with_failures(self) -> None:
        """Version 0 -> 1, once per db: a rollout recorded as ``succeeded`` although one of
        its devices' last attempt failed is what version 1 calls ``completed_with_failures``
        (no retry is left once a rollout is finished, so the last attempt is final)."""
        failed = ", ".join(f"'{s}'" for s in EXEC_FAILED)
        self.db.execute(f"""
            UPDATE rollouts SET state = 'completed_with_failures'
            WHERE state = 'succeeded' AND EXISTS (
                SELECT 1 FROM executions e
                WHERE e.rollout_id = rollouts.id AND e.kind = 'job'
                  AND (e.status IN ({failed})
                       OR (e.status = 'SUCCEEDED' AND e.outcome = 'rolled_back'))
                  AND e.attempt = (SELECT MAX(x.attempt) FROM executions x
                                   WHERE x.rollout_id = e.rollout_id AND x.kind = 'job'
                                     AND x.device = e.device))""")

    def close(self) -> None:
        self.db.close()

    def tx(self) -> AbstractContextManager[Database]:
        return self.db.tx()

    # --- rollouts ---------------------------------------------------------------------

    def create_rollout(self, plan: RolloutPlan, targets: list[str]) -> Rollout:
        """The rollout, its waves and its target snapshot in one transaction. Two creators
        racing for the same name (replicas on one PostgreSQL): the loser retries with the
        next free name."""
        for _ in range(5):
            try:
                return self._create_rollout(plan, targets)
            except IntegrityError:
                continue
        raise RuntimeError(f"rollout {plan.name}: no free id after 5 tries")

    def _create_rollout(self, plan: RolloutPlan, targets: list[str]) -> Rollout:
        now = time.time()
        ordered = sorted(targets)
        sizes = plan.wave_sizes(len(ordered))
        with self.tx() as db:
            n = db.scalar("SELECT COUNT(*) FROM rollouts WHERE id = :id OR id LIKE :like",
                          {"id": plan.name, "like": plan.name + "-%"})
            rid = plan.name if n == 0 else f"{plan.name}-{n + 1}"
            db.execute(
                "INSERT INTO rollouts (id, nonce, plan, state, created_at, updated_at) "
                "VALUES (:id, :nonce, :plan, 'running', :now, :now)",
                {"id": rid, "nonce": secrets.token_hex(3), "plan": plan.model_dump_json(),
                 "now": now})
            db.executemany(
                "INSERT INTO waves (rollout_id, idx, target, state) "
                "VALUES (:rid, :idx, :target, 'pending')",
                [{"rid": rid, "idx": i, "target": s} for i, s in enumerate(sizes)])
            rows = []
            for pos, dev in enumerate(ordered):
                wave = next(i for i, s in enumerate(sizes) if pos < s) if pos < sizes[-1] else -1
                rows.append({"rid": rid, "dev": dev, "pos": pos, "wave": wave})
            db.executemany("INSERT INTO targets (rollout_id, device, pos, wave) "
                           "VALUES (:rid, :dev, :pos, :wave)", rows)
        rollout = self.rollout(rid)
        assert rollout is not None
        return rollout

    def rollout(self, rid: str) -> Rollout | None:
        row = self.db.execute(
            "SELECT id, nonce, plan, state, reason, request, created_at, updated_at, finished_at, "
            "controls FROM rollouts WHERE id = :id", {"id": rid}).fetchone()
        if row is None:
            return None
        return Rollout(row[0], row[1], RolloutPlan.model_validate_json(row[2]), *row[3:9],
                       controls=json.loads(row[9]) if row[9] else {})

    def rollouts(self, states: Iterable[str] | None = None) -> list[Rollout]:
        ids = [r[0] for r in self.db.execute("SELECT id FROM rollouts ORDER BY created_at")]
        out = [r for r in (self.rollout(i) for i in ids) if r is not None]
        return [r for r in out if states is None or r.state in states]

    def set_rollout_state(self, rid: str, state: str, reason: str | None = None) -> None:
        now = time.time()
        final = now if state in ROLLOUT_FINAL else None
        self.db.execute(
            "UPDATE rollouts SET state = :state, reason = COALESCE(:reason, reason), "
            "updated_at = :now, finished_at = COALESCE(:final, finished_at) WHERE id = :id",
            {"state": state, "reason": reason, "now": now, "final": final, "id": rid})

    def save_controls(self, rid: str, controls: dict[str, Any]) -> None:
        self.db.execute("UPDATE rollouts SET controls = :c WHERE id = :id",
                        {"c": json.dumps(controls, sort_keys=True), "id": rid})

    def save_plan(self, rid: str, plan: RolloutPlan) -> None:
        self.db.execute("UPDATE rollouts SET plan = :plan WHERE id = :id",
                        {"plan": plan.model_dump_json(), "id": rid})

    def reopen_for_rollback(self, rid: str) -> bool:
        """A finished rollout goes back to work (rolling_back) for the next controller; True
        when it was finished. No controller drives a finished rollout, so none races this."""
        cur = self.db.execute(
            f"UPDATE rollouts SET state = 'rolling_back', updated_at = :now, finished_at = NULL "
            f"WHERE id = :id AND state IN ({_quoted(ROLLOUT_FINAL)})",
            {"now": time.time(), "id": rid})
        return cur.rowcount == 1

    def post_request(self, rid: str, request: str,
                     states: Iterable[str] | None = None) -> bool:
        """Leave ``request`` for the controller; with ``states``, only while the rollout is
        in one of them (checked in the same statement). True when it was posted."""
        if request.partition(":")[0] not in REQUESTS:
            raise ValueError(f"request {request!r}: one of {', '.join(REQUESTS)}")
        q = "UPDATE rollouts SET request = :req, updated_at = :now WHERE id = :id"
        if states is not None:
            allowed = tuple(states)
            if any(s not in ROLLOUT_ACTIVE + ROLLOUT_FINAL for s in allowed):
                raise ValueError(f"states {allowed}: rollout states only")
            q += f" AND state IN ({_quoted(allowed)})"
        return self.db.execute(q, {"req": request, "now": time.time(), "id": rid}).rowcount == 1

    def take_request(self, rid: str) -> str | None:
        # Read first: the controller asks every turn, and a write per turn would contend with
        # `fleetctl rollout status` readers for nothing. The clearing UPDATE names the request
        # it read, so of two takers (a replica losing its lease) only one gets it.
        req = self.db.scalar("SELECT request FROM rollouts WHERE id = :id", {"id": rid})
        if not req:
            return None
        cur = self.db.execute("UPDATE rollouts SET request = NULL WHERE id = :id AND "
                              "request = :req", {"id": rid, "req": req})
        return str(req) if cur.rowcount == 1 else None

    # --- waves and targets -------------------------------------------------------------

    def waves(self, rid: str) -> list[Wave]:
        rows = self.db.execute(
            "SELECT rollout_id, idx, target, state, started_at, finished_at, bake_until "
            "FROM waves WHERE rollout_id = :id ORDER BY idx", {"id": rid})
        return [Wave(*r) for r in rows]

    def save_wave(self, w: Wave) -> None:
        self.db.execute(
            "UPDATE waves SET state = :state, started_at = :started, finished_at = :finished, "
            "bake_until = :bake WHERE rollout_id = :rid AND idx = :idx",
            {"state": w.state, "started": w.started_at, "finished": w.finished_at,
             "bake": w.bake_until, "rid": w.rollout_id, "idx": w.idx})

    def add_target(self, rid: str, device: str, wave: int) -> None:
        """A device that joined the rollout's group (``follow_group``) goes into ``wave``:
        its target row, and one more device in that wave's and the later waves' cumulative
        targets, in one transaction."""
        with self.tx() as db:
            pos = db.scalar("SELECT COALESCE(MAX(pos), -1) + 1 FROM targets "
                            "WHERE rollout_id = :id", {"id": rid})
            db.execute("INSERT INTO targets (rollout_id, device, pos, wave) "
                       "VALUES (:rid, :dev, :pos, :wave)",
                       {"rid": rid, "dev": device, "pos": pos, "wave": wave})
            db.execute("UPDATE waves SET target = target + 1 WHERE rollout_id = :rid "
                       "AND idx >= :wave", {"rid": rid, "wave": wave})

    def targets(self, rid: str) -> list[tuple[str, int]]:
        """(device, wave) in rollout order; wave -1 = beyond the plan's last wave."""
        rows = self.db.fetch_raw(
            "SELECT device, wave FROM targets WHERE rollout_id = :id ORDER BY pos", {"id": rid})
        return [(str(d), int(w)) for d, w in rows]

    # --- executions --------------------------------------------------------------------

    def executions(self, rid: str, kind: str | None = None) -> list[Execution]:
        q = f"SELECT {_EXEC_COLS} FROM executions WHERE rollout_id = :rid"
        if kind is not None:
            q += " AND kind = :kind"
        rows = self.db.execute(q + " ORDER BY created_at, id", {"rid": rid, "kind": kind})
        return [Execution.from_row(r) for r in rows]

    def execution_rows(self, rid: str) -> list[tuple[Any, ...]]:
        """A rollout's executions as raw rows (``Execution.from_row`` makes each one), in
        :meth:`executions`' order: for a reader that rebuilds only the rows that changed."""
        return self.db.fetch_raw(f"SELECT {_EXEC_COLS} FROM executions WHERE rollout_id = :rid "
                                 "ORDER BY created_at, id", {"rid": rid})

    def save_executions(self, execs: Iterable[Execution], owner: str = "") -> None:
        """Upsert in one transaction: the controller batches every change of a loop turn.
        ``owner``: the replica saving (its leases' owner name); a row of a rollout another
        replica holds is left as that one wrote it."""
        fence = {"lease_owner": owner, "lease_now": time.time()}
        rows = [e.row() | fence for e in execs]
        if rows:
            with self.tx() as db:
                db.executemany(_EXEC_UPSERT, rows)


def _quoted(words: Iterable[str]) -> str:
    """A SQL list of our own constant words (never user input: those are bound)."""
    out = []
    for w in words:
        if not w.replace("_", "").isalnum():
            raise ValueError(f"{w!r}: not a state name")
        out.append(f"'{w}'")
    return ", ".join(out)
