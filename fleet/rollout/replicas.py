"""What lets several controller processes share one PostgreSQL db: leases and the inbox.

- **Leases.** Each rollout (and each learn: key ``learn:<id>``) is driven by one replica at a
  time: the one holding its row in ``leases`` (owner, expires_at). A replica renews what it
  holds every ``lease_s / 3``; a replica that dies (SIGKILL) stops renewing, and another takes
  the rollout over once the lease has expired: it loads the rollout from the db and re-sends
  every open execution with its original id, so a device that already has it answers
  DUPLICATE with where it stands — never a second run, never a new id. Taking and renewing is
  one conditional upsert (free, expired or already mine), atomic on both engines.
- **Inbox.** Results arrive on ``$share/fleetctl/...``: each reaches exactly one replica, not
  necessarily the one holding its rollout. A replica applies a result of its own rollouts at
  once and writes any other into ``inbox`` (only when the execution exists: a stranger's
  result is dropped); the holder drains its rollouts' rows each turn and applies them.
  Applying is idempotent by execution id (``Controller.on_result``), so a row applied twice
  (a replica killed between applying and deleting) changes nothing.

Clocks: ``expires_at`` is the writer's wall clock, so replicas need synchronized clocks (NTP)
to well under ``lease_s``; the default 15 s leaves room for the usual milliseconds.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable

from contract import Result
from fleet.db import Database

log = logging.getLogger("fleet.replicas")

DEFAULT_LEASE_S = 15.0
INBOX_KEEP_S = 24 * 3600.0
SHARE_GROUP = "fleetctl"
"""The shared-subscription group every replica's results subscription joins."""


def replica_name() -> str:
    """This process, as a lease owner and in its MQTT client id: host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Replica:
    """One controller process among several on a PostgreSQL db."""

    def __init__(self, db: Database, owner: str, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.db = db
        self.owner = owner
        self.lease_s = lease_s
        self.held: set[str] = set()
        self._renewed = 0.0
        self._deferred: list[dict[str, object]] = []

    # --- leases -------------------------------------------------------------------------

    def acquire(self, key: str) -> bool:
        """Take (or keep) ``key``'s lease: True when it is ours now."""
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO leases (rollout_id, owner, expires_at) VALUES (:key, :me, :exp) "
            "ON CONFLICT (rollout_id) DO UPDATE SET owner = excluded.owner, "
            "expires_at = excluded.expires_at "
            "WHERE leases.owner = :me OR leases.expires_at < :now",
            {"key": key, "me": self.owner, "exp": now + self.lease_s, "now": now})
        if cur.rowcount == 1:
            if key not in self.held:
                log.info("lease taken", extra={"lease": key, "owner": self.owner})
            self.held.add(key)
            return True
        self.held.discard(key)
        return False

    def renew(self, now: float) -> set[str]:
        """Every ``lease_s / 3``: extend what we hold; the keys we lost (another replica took
        them after ours expired: this process stalled) come back, to be dropped."""
        if now - self._renewed < self.lease_s / 3 or not self.held:
            return set()
        self._renewed = now
        before = set(self.held)
        lost = {k for k in sorted(before) if not self.acquire(k)}
        self.prune(now)
        for k in lost:
            log.warning("lease lost", extra={"lease": k, "owner": self.owner})
        return lost

    def release(self, key: str) -> None:
        """A finished rollout: let the lease go now (it would expire anyway)."""
        self.db.execute("DELETE FROM leases WHERE rollout_id = :key AND owner = :me",
                        {"key": key, "me": self.owner})
        self.held.discard(key)

    def release_all(self) -> None:
        for key in list(self.held):
            self.release(key)

    # --- the inbox ----------------------------------------------------------------------

    def defer(self, device: str, r: Result) -> None:
        """A result of a rollout another replica drives: to the inbox at the next flush."""
        self._deferred.append({"exec_id": r.id, "device": device,
                               "body": r.model_dump_json(), "t": time.time()})

    def flush(self) -> None:
        """Write the deferred results; only those whose execution exists (its command was
        saved before it was sent: a result for no execution is no rollout's)."""
        rows, self._deferred = self._deferred, []
        if not rows:
            return
        with self.db.tx() as db:
            db.executemany(
                "INSERT INTO inbox (exec_id, device, body, received_at) "
                "SELECT :exec_id, :device, :body, :t "
                "WHERE EXISTS (SELECT 1 FROM executions WHERE id = :exec_id)", rows)

    def prune(self, now: float) -> int:
        """Inbox rows no replica applied within ``INBOX_KEEP_S`` (their rollout was loaded
        nowhere since): gone, so the table stays bounded. The count removed."""
        return int(self.db.execute("DELETE FROM inbox WHERE received_at < :t",
                                   {"t": now - INBOX_KEEP_S}).rowcount)

    def drain(self, rollouts: Iterable[str]) -> list[tuple[int, str, Result]]:
        """The inbox rows of these rollouts, oldest first: (seq, device, result)."""
        rids = sorted(rollouts)
        if not rids:
            return []
        marks = ", ".join(f":r{i}" for i in range(len(rids)))
        rows = self.db.execute(
            "SELECT i.seq, i.device, i.body FROM inbox i JOIN executions e "
            f"ON e.id = i.exec_id WHERE e.rollout_id IN ({marks}) ORDER BY i.seq",
            {f"r{i}": r for i, r in enumerate(rids)}).fetchall()
        return [(int(seq), str(dev), Result.model_validate_json(body))
                for seq, dev, body in rows]

    def applied(self, seqs: list[int]) -> None:
        """Inbox rows applied (their executions saved first): gone."""
        if seqs:
            self.db.executemany("DELETE FROM inbox WHERE seq = :seq",
                                [{"seq": s} for s in seqs])
