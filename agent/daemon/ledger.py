"""The daemon's ledger: the commands it answered itself and the results it announced.

Two tables in the outbox database (``<state_dir>/agent.db``, see :mod:`agent.mqtt.outbox`),
beside the outbox rows, so a result, its outbox row and its record here commit in one
transaction:

- ``commands``: every command that is not a job (and every rejection of a non-job command),
  keyed on its id, with the status, result and error a repeat is answered with (DUPLICATE).
  Jobs live in the job store instead.
- ``announced``: each ``(id, status)`` the device has put in the outbox (IN_PROGRESS aside), so
  after a crash the daemon knows exactly which states it still owes: a job's ACCEPTED and its
  one terminal status are announced once and only once, however often the daemon restarts.

:class:`Ledger` holds every statement on these two tables. A method that writes takes the open
:class:`~agent.mqtt.outbox.Tx`, so the caller decides what else commits with it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from agent.mqtt.outbox import Outbox, Tx

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS commands (
    id TEXT PRIMARY KEY, type TEXT NOT NULL, status TEXT NOT NULL, result TEXT, error TEXT,
    ts REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS announced (
    id TEXT NOT NULL, status TEXT NOT NULL, PRIMARY KEY (id, status)
)""",
)


@dataclass(frozen=True)
class StoredCommand:
    """Where a command of the ``commands`` table stands: what a repeat of it is told."""

    status: str
    result: dict[str, Any] | None
    error: dict[str, Any] | None


class Ledger:
    """The ``commands`` and ``announced`` tables of one outbox database."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        with outbox.tx() as tx:
            for statement in _SCHEMA:
                tx.conn.execute(statement)

    # -- commands answered by the daemon itself -------------------------------------------

    def record_command(
        self, tx: Tx, cid: str, type_: str, status: str, result: dict[str, Any] | None,
        error: dict[str, Any] | None,
    ) -> None:
        """Keep how a non-job command ended, in ``tx``; the first record of an id stays."""
        tx.conn.execute(
            "INSERT OR IGNORE INTO commands (id, type, status, result, error, ts) "
            "VALUES (?,?,?,?,?,?)",
            (cid, type_, status, json.dumps(result) if result else None,
             json.dumps(error) if error else None, time.time()),
        )

    def stored_command(self, cid: str) -> StoredCommand | None:
        """The record of a non-job command, or None when the id was never recorded (or was
        pruned)."""
        row = self.outbox.query("SELECT status, result, error FROM commands WHERE id=?", (cid,))
        if not row:
            return None
        return StoredCommand(
            status=row[0][0],
            result=json.loads(row[0][1]) if row[0][1] else None,
            error=json.loads(row[0][2]) if row[0][2] else None,
        )

    # -- announcements --------------------------------------------------------------------

    def mark_announced(self, tx: Tx, cid: str, status: str) -> None:
        """Note in ``tx`` that ``status`` of ``cid`` went into the outbox."""
        tx.conn.execute("INSERT OR IGNORE INTO announced (id, status) VALUES (?, ?)",
                        (cid, status))

    def announced(self, cid: str, tx: Tx | None = None) -> set[str]:
        """The statuses of ``cid`` already announced; read inside ``tx`` when given (to decide
        what to announce in the same transaction), else on its own."""
        sql, args = "SELECT status FROM announced WHERE id=?", (cid,)
        rows = tx.conn.execute(sql, args).fetchall() if tx is not None else (
            self.outbox.query(sql, args))
        return {r[0] for r in rows}

    # -- history --------------------------------------------------------------------------

    def prune(
        self, tx: Tx, *, older_than: float, keep_commands: int, job_ids: list[str]
    ) -> list[str]:
        """Forget, in ``tx``, command records older than ``older_than`` (a time.time()) or
        beyond the newest ``keep_commands``, with their announcements, and the announcements
        of the pruned jobs ``job_ids``. Returns the command ids forgotten."""
        old = [r[0] for r in tx.conn.execute(
            "SELECT id FROM commands WHERE ts < ? OR id NOT IN (SELECT id FROM commands "
            "ORDER BY ts DESC LIMIT ?)", (older_than, keep_commands)).fetchall()]
        tx.delete_in("commands", "id", old)
        tx.delete_in("announced", "id", old + job_ids)
        return old
