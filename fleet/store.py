"""The controller's durable state: rollouts, their waves and every execution, in SQLite (WAL).

Written before anything is published, so a controller killed at any instant restarts from
here. Why ``synchronous=NORMAL`` is enough: a process kill never loses a committed WAL
transaction, and even a power cut that loses the last ones is safe, because execution ids are
deterministic (rollout, device, attempt) — a re-planned execution gets the id the device has
already seen and is answered DUPLICATE instead of running twice.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.plan import RolloutPlan

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    nonce TEXT NOT NULL,
    plan TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    request TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL
);
CREATE TABLE IF NOT EXISTS waves (
    rollout_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    target INTEGER NOT NULL,
    state TEXT NOT NULL,
    started_at REAL,
    finished_at REAL,
    bake_until REAL,
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
    created_at REAL NOT NULL,
    sent_at REAL,
    started_at REAL,
    finished_at REAL,
    outcome TEXT,
    metric_before REAL,
    metric_after REAL,
    error_code TEXT,
    error_message TEXT,
    result TEXT
);
CREATE INDEX IF NOT EXISTS executions_rollout ON executions (rollout_id, kind, device);
"""

ROLLOUT_ACTIVE = ("running", "paused", "aborting", "rolling_back")
ROLLOUT_FINAL = ("succeeded", "completed_with_failures", "aborted", "rolled_back")
"""``succeeded``: every wave done and every targeted device succeeded;
``completed_with_failures``: every wave done, but at least one device failed for good (the
failure rate stayed under the plan's abort threshold)."""
REQUESTS = ("pause", "resume", "abort", "rollback")

EXEC_FAILED = ("FAILED", "TIMED_OUT", "EXPIRED", "REJECTED")
"""Terminal execution statuses that are failures (a SUCCEEDED whose outcome is rolled_back,
the device's own gates refusing the model, is one too)."""
SCHEMA_VERSION = 1
"""``PRAGMA user_version``. 1: a finished rollout with a failed device is
``completed_with_failures`` (version 0 called it ``succeeded``)."""
EXEC_OPEN = ("PLANNED", "SENT", "ACCEPTED", "IN_PROGRESS")
"""Controller-side execution states before the terminal ones of the contract."""


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

    @property
    def open(self) -> bool:
        return self.status in EXEC_OPEN

    def row(self) -> tuple[Any, ...]:
        return (
            self.id, self.rollout_id, self.device, self.wave, self.kind, self.attempt,
            self.status, self.created_at, self.sent_at, self.started_at, self.finished_at,
            self.outcome, self.metric_before, self.metric_after, self.error_code,
            self.error_message, None if self.result is None else json.dumps(self.result),
        )


_EXEC_COLS = (
    "id, rollout_id, device, wave, kind, attempt, status, created_at, sent_at, started_at, "
    "finished_at, outcome, metric_before, metric_after, error_code, error_message, result"
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


class FleetStore:
    """One connection per process; the controller writes, ``fleetctl rollout`` reads and
    posts operator requests (pause, resume, abort, rollback) that the controller applies."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=30000")
        self.db.executescript(SCHEMA)
        if self.db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            self._migrate()

    def _migrate(self) -> None:
        """Version 0 -> 1, once per db: a rollout recorded as ``succeeded`` although one of
        its devices' last attempt failed is what version 1 calls ``completed_with_failures``
        (no retry is left once a rollout is finished, so the last attempt is final)."""
        failed = ", ".join(f"'{s}'" for s in EXEC_FAILED)
        with self.tx() as db:
            db.execute(f"""
                UPDATE rollouts SET state = 'completed_with_failures'
                WHERE state = 'succeeded' AND EXISTS (
                    SELECT 1 FROM executions e
                    WHERE e.rollout_id = rollouts.id AND e.kind = 'job'
                      AND (e.status IN ({failed})
                           OR (e.status = 'SUCCEEDED' AND e.outcome = 'rolled_back'))
                      AND e.attempt = (SELECT MAX(x.attempt) FROM executions x
                                       WHERE x.rollout_id = e.rollout_id AND x.kind = 'job'
                                         AND x.device = e.device))""")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- rollouts ---------------------------------------------------------------------

    def create_rollout(self, plan: RolloutPlan, targets: list[str]) -> Rollout:
        """The rollout, its waves and its target snapshot in one transaction."""
        now = time.time()
        ordered = sorted(targets)
        sizes = plan.wave_sizes(len(ordered))
        with self.tx() as db:
            n = db.execute(
                "SELECT COUNT(*) FROM rollouts WHERE id = ? OR id LIKE ?",
                (plan.name, plan.name + "-%"),
            ).fetchone()[0]
            rid = plan.name if n == 0 else f"{plan.name}-{n + 1}"
            db.execute(
                "INSERT INTO rollouts (id, nonce, plan, state, created_at, updated_at) "
                "VALUES (?, ?, ?, 'running', ?, ?)",
                (rid, secrets.token_hex(3), plan.model_dump_json(), now, now),
            )
            db.executemany(
                "INSERT INTO waves (rollout_id, idx, target, state) VALUES (?, ?, ?, 'pending')",
                [(rid, i, s) for i, s in enumerate(sizes)],
            )
            rows = []
            for pos, dev in enumerate(ordered):
                wave = next(i for i, s in enumerate(sizes) if pos < s) if pos < sizes[-1] else -1
                rows.append((rid, dev, pos, wave))
            db.executemany(
                "INSERT INTO targets (rollout_id, device, pos, wave) VALUES (?, ?, ?, ?)", rows
            )
        rollout = self.rollout(rid)
        assert rollout is not None
        return rollout

    def rollout(self, rid: str) -> Rollout | None:
        row = self.db.execute(
            "SELECT id, nonce, plan, state, reason, request, created_at, updated_at, finished_at "
            "FROM rollouts WHERE id = ?",
            (rid,),
        ).fetchone()
        if row is None:
            return None
        return Rollout(row[0], row[1], RolloutPlan.model_validate_json(row[2]), *row[3:])

    def rollouts(self, states: Iterable[str] | None = None) -> list[Rollout]:
        ids = [r[0] for r in self.db.execute("SELECT id FROM rollouts ORDER BY created_at")]
        out = [r for r in (self.rollout(i) for i in ids) if r is not None]
        return [r for r in out if states is None or r.state in states]

    def set_rollout_state(self, rid: str, state: str, reason: str | None = None) -> None:
        now = time.time()
        final = now if state in ROLLOUT_FINAL else None
        self.db.execute(
            "UPDATE rollouts SET state = ?, reason = COALESCE(?, reason), updated_at = ?, "
            "finished_at = COALESCE(?, finished_at) WHERE id = ?",
            (state, reason, now, final, rid),
        )

    def save_plan(self, rid: str, plan: RolloutPlan) -> None:
        self.db.execute("UPDATE rollouts SET plan = ? WHERE id = ?", (plan.model_dump_json(), rid))

    def reopen_for_rollback(self, rid: str) -> bool:
        """A finished rollout goes back to work (rolling_back) for the next controller; True
        when it was finished. No controller drives a finished rollout, so none races this."""
        marks = ", ".join("?" * len(ROLLOUT_FINAL))
        cur = self.db.execute(
            f"UPDATE rollouts SET state = 'rolling_back', updated_at = ?, finished_at = NULL "
            f"WHERE id = ? AND state IN ({marks})",
            (time.time(), rid, *ROLLOUT_FINAL),
        )
        return cur.rowcount == 1

    def post_request(self, rid: str, request: str,
                     states: Iterable[str] | None = None) -> bool:
        """Leave ``request`` for the controller; with ``states``, only while the rollout is
        in one of them (checked in the same statement). True when it was posted."""
        if request not in REQUESTS:
            raise ValueError(f"request {request!r}: one of {', '.join(REQUESTS)}")
        q = "UPDATE rollouts SET request = ?, updated_at = ? WHERE id = ?"
        params: tuple[Any, ...] = (request, time.time(), rid)
        if states is not None:
            allowed = tuple(states)
            q += f" AND state IN ({', '.join('?' * len(allowed))})"
            params += allowed
        return self.db.execute(q, params).rowcount == 1

    def take_request(self, rid: str) -> str | None:
        # Read first: the controller asks every turn, and a write transaction per turn would
        # contend with `fleetctl rollout status` readers for nothing.
        row = self.db.execute("SELECT request FROM rollouts WHERE id = ?", (rid,)).fetchone()
        if not row or not row[0]:
            return None
        with self.tx() as db:
            row = db.execute("SELECT request FROM rollouts WHERE id = ?", (rid,)).fetchone()
            if row and row[0]:
                db.execute("UPDATE rollouts SET request = NULL WHERE id = ?", (rid,))
                return str(row[0])
        return None

    # --- waves and targets -------------------------------------------------------------

    def waves(self, rid: str) -> list[Wave]:
        rows = self.db.execute(
            "SELECT rollout_id, idx, target, state, started_at, finished_at, bake_until "
            "FROM waves WHERE rollout_id = ? ORDER BY idx",
            (rid,),
        )
        return [Wave(*r) for r in rows]

    def save_wave(self, w: Wave) -> None:
        self.db.execute(
            "UPDATE waves SET state = ?, started_at = ?, finished_at = ?, bake_until = ? "
            "WHERE rollout_id = ? AND idx = ?",
            (w.state, w.started_at, w.finished_at, w.bake_until, w.rollout_id, w.idx),
        )

    def targets(self, rid: str) -> list[tuple[str, int]]:
        """(device, wave) in rollout order; wave -1 = beyond the plan's last wave."""
        rows = self.db.execute(
            "SELECT device, wave FROM targets WHERE rollout_id = ? ORDER BY pos", (rid,)
        )
        return [(str(d), int(w)) for d, w in rows]

    # --- executions --------------------------------------------------------------------

    def executions(self, rid: str, kind: str | None = None) -> list[Execution]:
        q = f"SELECT {_EXEC_COLS} FROM executions WHERE rollout_id = ?"
        params: tuple[Any, ...] = (rid,)
        if kind is not None:
            q += " AND kind = ?"
            params += (kind,)
        out = []
        for r in self.db.execute(q + " ORDER BY created_at, id", params):
            e = Execution(*r)
            e.result = None if r[-1] is None else json.loads(r[-1])
            out.append(e)
        return out

    def save_executions(self, execs: Iterable[Execution]) -> None:
        """Upsert in one transaction: the controller batches every change of a loop turn."""
        rows = [e.row() for e in execs]
        if not rows:
            return
        with self.tx() as db:
            db.executemany(
                f"INSERT OR REPLACE INTO executions ({_EXEC_COLS}) "
                f"VALUES ({', '.join('?' * 17)})",
                rows,
            )
