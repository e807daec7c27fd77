"""The on-disk outbox: every QoS 1 message the device owes the fleet, until the broker acks it.

paho keeps unacknowledged QoS 1 messages in memory only, so a result produced while the broker
is down, or just before a kill -9, would die with the process. Here a message is a row of
``<state_dir>/agent.db`` first (``synchronous=FULL``); the link publishes it and deletes the row
on PUBACK; a new process publishes whatever rows are left. Delivery is therefore at least once:
a crash between the broker's PUBACK and the delete resends the row with its original ``seq``,
which is how the fleet tells a repeat from a new message.

The same database keeps the daemon's counters (result/event ``seq``, ``conn_seq``) and its
ledger (the command and announcement tables, created and queried by ``agent.daemon.ledger``),
so a result and the fact that it was announced commit in one transaction. This module owns
only the ``outbox`` and ``counters`` tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DB_NAME = "agent.db"
WAL_LIMIT_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    rowid INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL, payload BLOB NOT NULL, qos INTEGER NOT NULL,
    retain INTEGER NOT NULL, props TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_IN_CHUNK = 500
"""Values per ``IN (...)`` list: SQLite builds before 3.32 take at most 999 parameters."""


@dataclass(frozen=True)
class OutMessage:
    rowid: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    props: dict[str, Any] | None
    """Publish properties: ``response_topic``, ``correlation_data_b64``, ``expiry_s``."""


class Tx:
    """One write transaction on the outbox database (see :meth:`Outbox.tx`)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.added: list[int] = []

    def next_seq(self, name: str) -> int:
        self.conn.execute(
            "INSERT INTO counters (name, value) VALUES (?, 0) "
            "ON CONFLICT(name) DO UPDATE SET value=value+1", (name,)
        )
        return int(self.conn.execute(
            "SELECT value FROM counters WHERE name=?", (name,)
        ).fetchone()[0])

    def put(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
        props: dict[str, Any] | None = None,
    ) -> int:
        cur = self.conn.execute(
            "INSERT INTO outbox (topic, payload, qos, retain, props) VALUES (?,?,?,?,?)",
            (topic, payload, qos, int(retain), json.dumps(props) if props else None),
        )
        rowid = int(cur.lastrowid or 0)
        self.added.append(rowid)
        return rowid

    def drop_counters(self, names: list[str]) -> None:
        """Forget counters (a pruned job's crash count): the next ``next_seq`` starts at 0."""
        self.delete_in("counters", "name", names)

    def delete_in(self, table: str, column: str, values: list[str]) -> None:
        """``DELETE FROM table WHERE column IN values``, in chunks; ``table`` and ``column``
        are this code's own names, never input."""
        for i in range(0, len(values), _IN_CHUNK):
            part = values[i:i + _IN_CHUNK]
            self.conn.execute(
                f"DELETE FROM {table} WHERE {column} IN ({','.join('?' * len(part))})", part)


class Outbox:
    """Thread-safe: one connection behind a lock (writes are milliseconds; the daemon's
    threads are few)."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = state_dir / DB_NAME
        if not self.path.exists():  # 0600 whatever the umask; -wal/-shm inherit the mode
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(
            self.path, timeout=30, isolation_level=None, check_same_thread=False
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        # Checkpoints fsync the database file: run them from the daemon's main loop
        # (checkpoint()), never inside a commit on paho's thread, where they were the p99.
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        # The WAL keeps its peak size (a burst of results while offline, a flood of refused
        # commands) unless told to shrink back after a checkpoint.
        self._conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        self._conn.executescript(_SCHEMA)
        self._ckpt: sqlite3.Connection | None = None

    @contextmanager
    def tx(self, durable: bool = True) -> Iterator[Tx]:
        """``durable=False`` commits without the fsync (WAL, ``synchronous=NORMAL``): the
        row survives a crash of the process but maybe not a power cut. Only for answers that
        change nothing on the device (ping, status), where the fsync was the whole latency."""
        with self._lock:
            if not durable:
                self._conn.execute("PRAGMA synchronous=NORMAL")
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                tx = Tx(self._conn)
                try:
                    yield tx
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            finally:
                if not durable:
                    self._conn.execute("PRAGMA synchronous=FULL")

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def pending(self, after: int = 0) -> list[OutMessage]:
        rows = self.query(
            "SELECT rowid, topic, payload, qos, retain, props FROM outbox WHERE rowid>? "
            "ORDER BY rowid", (after,),
        )
        return [OutMessage(r[0], r[1], bytes(r[2]), r[3], bool(r[4]),
                           json.loads(r[5]) if r[5] else None) for r in rows]

    def done(self, rowid: int) -> None:
        """Forget a row the broker acknowledged. Without an fsync: this runs on paho's thread
        for every PUBACK (two per ping), and a delete lost to a power cut only resends the
        row with its original seq, which at-least-once delivery allows."""
        with self._lock:
            self._conn.execute("PRAGMA synchronous=NORMAL")
            try:
                self._conn.execute("DELETE FROM outbox WHERE rowid=?", (rowid,))
            finally:
                self._conn.execute("PRAGMA synchronous=FULL")

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (PASSIVE: never waits for, nor blocks, a
        writer), on a connection of its own so the outbox lock is not held meanwhile."""
        if self._ckpt is None:
            self._ckpt = sqlite3.connect(self.path, timeout=1, isolation_level=None,
                                         check_same_thread=False)
        self._ckpt.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def count(self) -> int:
        return int(self.query("SELECT COUNT(*) FROM outbox")[0][0])

    def close(self) -> None:
        with self._lock:
            if self._ckpt is not None:
                self._ckpt.close()
            self._conn.close()
