"""The device's job store: every job and each of its steps, durable in ``<state_dir>/jobs.db``.

SQLite in WAL mode with ``synchronous=FULL``: a call returns only after its row is on disk,
so a caller may announce a transition (MQTT result, progress line) right after it. The daemon,
the worker and ``agentctl`` open the same file from different processes; each process (and
thread) keeps its own connection and waits on a busy timeout instead of failing on a lock.

Torch-free on purpose: the daemon's idle loop imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

DB_NAME = "jobs.db"
WAL_LIMIT_BYTES = 1 << 20
BUSY_TIMEOUT_MS = 30_000
"""A writer holds the lock for milliseconds; 30 s only matters on a stalled SD card."""


class JobState(str, Enum):
    QUEUED = "QUEUED"
    IN_PROGRESS = "IN_PROGRESS"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"
    TIMED_OUT = "TIMED_OUT"
    REJECTED = "REJECTED"


TERMINAL = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.TIMED_OUT, JobState.REJECTED}
)

_LEGAL: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset(
        {JobState.IN_PROGRESS, JobState.CANCELED, JobState.TIMED_OUT, JobState.FAILED}
    ),
    # IN_PROGRESS -> IN_PROGRESS is a resume: a worker picks the job up again (attempt += 1).
    JobState.IN_PROGRESS: frozenset({JobState.IN_PROGRESS} | TERMINAL) - {JobState.REJECTED},
}

STEP_STATUSES = ("running", "done", "failed", "skipped")


class JobStoreError(Exception):
    """An illegal transition or an unknown job id; the message names both sides."""


class QueueFull(JobStoreError):
    """``submit(max_queued=N)`` found N jobs already waiting."""


@dataclass(frozen=True)
class JobRecord:
    id: str
    type: str
    spec: dict
    state: JobState
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    timeout_s: float | None
    cancel_requested: bool
    result: dict | None
    error: dict | None
    progress: dict | None
    source: str
    reply: dict | None
    attempt: int

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True)
class StepRecord:
    job_id: str
    name: str
    status: str
    started_at: float | None
    finished_at: float | None
    outputs: dict | None
    error: dict | None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    type TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    timeout_s REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    error TEXT,
    progress TEXT,
    source TEXT NOT NULL,
    reply TEXT,
    attempt INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS steps (
    ord INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at REAL,
    finished_at REAL,
    outputs TEXT,
    error TEXT,
    UNIQUE(job_id, name)
);
"""

_JOB_COLS = (
    "id, type, spec, state, created_at, updated_at, started_at, finished_at, timeout_s, "
    "cancel_requested, result, error, progress, source, reply, attempt"
)


def _dumps(obj: Any) -> str | None:
    return None if obj is None else json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _job(row: tuple) -> JobRecord:
    return JobRecord(
        id=row[0], type=row[1], spec=json.loads(row[2]), state=JobState(row[3]),
        created_at=row[4], updated_at=row[5], started_at=row[6], finished_at=row[7],
        timeout_s=row[8], cancel_requested=bool(row[9]), result=_loads(row[10]),
        error=_loads(row[11]), progress=_loads(row[12]), source=row[13],
        reply=_loads(row[14]), attempt=row[15],
    )


class JobStore:
    """One device's jobs. Cheap to construct; connections open lazily per process/thread."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / DB_NAME
        self._local = threading.local()
        self._schema_ready = False

    # -- connection ---------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        # A forked child must not reuse its parent's connection (SQLite forbids it).
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            return conn
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Created 0600 whatever the umask (agentctl runs in a login shell's 022); SQLite gives
        # the -wal and -shm files the database file's mode.
        if not self.path.exists():
            with contextlib.suppress(FileExistsError):  # another process won the race
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        conn = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
            check_same_thread=True,
        )
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        # A burst of writes (a flood of refused commands) grows the WAL; it shrinks back to
        # this after the next checkpoint instead of keeping its peak size on the SD card.
        conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        if not self._schema_ready:
            with _immediate(conn):
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
            self._schema_ready = True
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def close(self) -> None:
        """Close this thread's connection (``with JobStore(...)``): left open, it would outlive
        the exit's skipped collection (registry.lifetime) and leave the -wal and -shm files."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            conn.close()
        self._local.conn = None

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        with _immediate(conn):
            yield conn

    # -- jobs ---------------------------------------------------------------------------

    def _get(self, conn: sqlite3.Connection, id: str) -> JobRecord | None:
        row = conn.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE id=?", (id,)).fetchone()
        return None if row is None else _job(row)

    def _must(self, conn: sqlite3.Connection, id: str) -> JobRecord:
        rec = self._get(conn, id)
        if rec is None:
            raise JobStoreError(f"no job with id {id!r} in {self.path}")
        return rec

    def _insert(
        self, id: str, type: str, spec: dict, state: JobState, *, timeout_s: float | None,
        source: str, reply: dict | None, error: dict | None = None,
        max_queued: int | None = None,
    ) -> tuple[JobRecord, bool]:
        now = time.time()
        finished = now if state in TERMINAL else None
        with self._tx() as conn:
            existing = self._get(conn, id)
            if existing is not None:
                return existing, False
            if max_queued is not None:  # counted inside the write lock: no overshoot
                (queued,) = conn.execute("SELECT COUNT(*) FROM jobs WHERE state=?",
                                         (JobState.QUEUED.value,)).fetchone()
                if queued >= max_queued:
                    raise QueueFull(f"{queued} jobs are queued already (the limit is "
                                    f"{max_queued}): retry once one has finished")
            conn.execute(
                "INSERT INTO jobs (id, type, spec, state, created_at, updated_at, finished_at, "
                "timeout_s, error, source, reply) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (id, type, _dumps(spec), state.value, now, now, finished, timeout_s,
                 _dumps(error), source, _dumps(reply)),
            )
            return self._must(conn, id), True

    def submit(
        self, id: str, type: str, spec: dict, *, timeout_s: float | None = None,
        source: str = "cli", reply: dict | None = None, max_queued: int | None = None,
    ) -> tuple[JobRecord, bool]:
        """Store a QUEUED job. An id seen before returns its stored record and ``False``;
        QueueFull when ``max_queued`` jobs are waiting already."""
        return self._insert(
            id, type, spec, JobState.QUEUED, timeout_s=timeout_s, source=source, reply=reply,
            max_queued=max_queued,
        )

    def reject(
        self, id: str, type: str, error: dict, *, source: str, reply: dict | None = None,
        spec: dict | None = None,
    ) -> tuple[JobRecord, bool]:
        """Store a command refused at validation, so a repeat of its id gets the same answer."""
        return self._insert(
            id, type, spec or {}, JobState.REJECTED, timeout_s=None, source=source,
            reply=reply, error=error,
        )

    def get(self, id: str) -> JobRecord | None:
        return self._get(self._conn(), id)

    def list(
        self, *, limit: int = 50, states: Iterable[JobState] | None = None
    ) -> list[JobRecord]:
        """Newest first."""
        sql, args = f"SELECT {_JOB_COLS} FROM jobs", []
        if states is not None:
            st = [JobState(s).value for s in states]
            sql += f" WHERE state IN ({','.join('?' * len(st))})"
            args += st
        sql += " ORDER BY seq DESC LIMIT ?"
        return [_job(r) for r in self._conn().execute(sql, [*args, limit]).fetchall()]

    def counts(self) -> dict[str, int]:
        """How many jobs the store holds in each state (states it holds none in are absent)."""
        rows = self._conn().execute("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        return {str(state): int(n) for state, n in rows.fetchall()}

    def next_queued(self) -> JobRecord | None:
        """The oldest QUEUED job."""
        row = self._conn().execute(
            f"SELECT {_JOB_COLS} FROM jobs WHERE state=? ORDER BY seq LIMIT 1",
            (JobState.QUEUED.value,),
        ).fetchone()
        return None if row is None else _job(row)

    def unfinished(self) -> list[JobRecord]:
        """IN_PROGRESS jobs, oldest first: resume these before starting a queued one."""
        rows = self._conn().execute(
            f"SELECT {_JOB_COLS} FROM jobs WHERE state=? ORDER BY seq",
            (JobState.IN_PROGRESS.value,),
        ).fetchall()
        return [_job(r) for r in rows]

    def transition(
        self, id: str, state: JobState, *, result: dict | None = None,
        error: dict | None = None,
    ) -> JobRecord:
        state = JobState(state)
        now = time.time()
        with self._tx() as conn:
            rec = self._must(conn, id)
            if state not in _LEGAL.get(rec.state, frozenset()):
                raise JobStoreError(
                    f"job {id!r}: illegal transition {rec.state.value} -> {state.value}"
                )
            sets = ["state=?", "updated_at=?"]
            args: list[Any] = [state.value, now]
            if state is JobState.IN_PROGRESS:
                sets.append("attempt=attempt+1")
                if rec.started_at is None:
                    sets.append("started_at=?")
                    args.append(now)
            if state in TERMINAL:
                sets.append("finished_at=?")
                args.append(now)
            if result is not None:
                sets.append("result=?")
                args.append(_dumps(result))
            if error is not None:
                sets.append("error=?")
                args.append(_dumps(error))
            conn.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id=?", [*args, id])
            return self._must(conn, id)

    def request_cancel(self, id: str) -> JobRecord:
        """Set the flag the worker polls; the caller decides what a queued job becomes."""
        with self._tx() as conn:
            self._must(conn, id)
            conn.execute(
                "UPDATE jobs SET cancel_requested=1, updated_at=? WHERE id=?", (time.time(), id)
            )
            return self._must(conn, id)

    def cancel_requested(self, id: str) -> bool:
        """One indexed read: cheap enough for every optimizer step."""
        row = self._conn().execute(
            "SELECT cancel_requested FROM jobs WHERE id=?", (id,)
        ).fetchone()
        return bool(row and row[0])

    def set_progress(self, id: str, progress: dict) -> None:
        with self._tx() as conn:
            conn.execute(
                "UPDATE jobs SET progress=?, updated_at=? WHERE id=?",
                (_dumps(progress), time.time(), id),
            )

    def prune(self, *, keep: int, older_than: float) -> list[str]:
        """Forget finished jobs (and their steps) beyond the ``keep`` that finished last, or
        finished before the epoch time ``older_than``; never a job that has not ended. Returns the
        pruned ids (their folders and logs are the caller's to remove)."""
        terminal = [s.value for s in TERMINAL]
        marks = ",".join("?" * len(terminal))
        with self._tx() as conn:
            rows = conn.execute(
                f"SELECT id FROM jobs WHERE state IN ({marks}) AND (finished_at < ? OR seq NOT "
                f"IN (SELECT seq FROM jobs WHERE state IN ({marks}) "
                "ORDER BY finished_at DESC, seq DESC LIMIT ?))",
                [*terminal, older_than, *terminal, keep]).fetchall()
            ids = [r[0] for r in rows]
            for chunk in range(0, len(ids), 500):
                part = ids[chunk:chunk + 500]
                q = ",".join("?" * len(part))
                conn.execute(f"DELETE FROM steps WHERE job_id IN ({q})", part)
                conn.execute(f"DELETE FROM jobs WHERE id IN ({q})", part)
        return ids

    def count(self, states: Iterable[JobState]) -> int:
        st = [JobState(s).value for s in states]
        (n,) = self._conn().execute(
            f"SELECT COUNT(*) FROM jobs WHERE state IN ({','.join('?' * len(st))})", st
        ).fetchone()
        return int(n)

    # -- steps --------------------------------------------------------------------------

    def _step(
        self, id: str, name: str, status: str, *, started: bool = False,
        outputs: dict | None = None, error: dict | None = None,
    ) -> None:
        now = time.time()
        with self._tx() as conn:
            self._must(conn, id)
            conn.execute(
                "INSERT INTO steps (job_id, name, status, started_at, finished_at, outputs, "
                "error) VALUES (?,?,?,?,?,?,?) ON CONFLICT(job_id, name) DO UPDATE SET "
                "status=excluded.status, "
                "started_at=COALESCE(excluded.started_at, steps.started_at), "
                "finished_at=excluded.finished_at, outputs=excluded.outputs, "
                "error=excluded.error",
                (id, name, status, now if started else None,
                 None if started else now, _dumps(outputs), _dumps(error)),
            )
            conn.execute("UPDATE jobs SET updated_at=? WHERE id=?", (now, id))

    def step_started(self, id: str, name: str) -> None:
        self._step(id, name, "running", started=True)

    def step_finished(self, id: str, name: str, outputs: dict | None = None) -> None:
        self._step(id, name, "done", outputs=outputs)

    def step_failed(self, id: str, name: str, error: dict) -> None:
        self._step(id, name, "failed", error=error)

    def step_skipped(self, id: str, name: str, why: str) -> None:
        self._step(id, name, "skipped", outputs={"why": why})

    def steps(self, id: str) -> list[StepRecord]:
        """In the order the steps first started."""
        rows = self._conn().execute(
            "SELECT job_id, name, status, started_at, finished_at, outputs, error FROM steps "
            "WHERE job_id=? ORDER BY ord",
            (id,),
        ).fetchall()
        return [
            StepRecord(r[0], r[1], r[2], r[3], r[4], _loads(r[5]), _loads(r[6])) for r in rows
        ]


@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    # BEGIN IMMEDIATE takes the write lock up front, so a read-then-write (duplicate check,
    # legal-transition check) cannot interleave with another process's write.
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
