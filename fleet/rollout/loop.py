"""The one loop every controller runs (messages in -> rollouts -> sends out), and a
replica's turn in it (its leases, the results other replicas received). ``ControllerLoop`` is
a part of ``fleet.rollout.controller.Controller``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from contract import Result, Status
from fleet.mqtt import FleetConnection
from fleet.rollout.replicas import Replica
from fleet.rollout.run import RolloutRun
from fleet.rollout.store import ROLLOUT_ACTIVE, FleetStore


class ControllerLoop:
    """``run``: drive rollouts to their end (mixed into ``Controller``)."""

    store: FleetStore
    conn: FleetConnection
    replica: Replica | None
    runs: dict[str, RolloutRun]
    on_progress: Callable[[RolloutRun], None] | None
    clock: Callable[[], float]
    _drained: list[int]
    take: Callable[[str], bool]
    drop: Callable[[str], None]
    tick: Callable[[RolloutRun, float], None]
    flush: Callable[[], None]
    on_result: Callable[[str, Result], None]
    on_status: Callable[[str, Status | None], None]

    def run(self, rids: list[str] | None = None, *, forever: bool = False,
            poll_s: float = 0.05, turn: Callable[[float], None] | None = None,
            rescan: Callable[[], None] | None = None,
            finished: Callable[[], bool] | None = None) -> dict[str, str]:
        """Drive the given rollouts (default: every active one) to a final state.

        The one loop every controller runs (messages in -> rollouts -> sends out). ``turn``
        (the learns' driver) acts after the rollouts each pass, its sends flushed with theirs;
        ``forever`` also takes rollouts (and, through ``rescan``, whatever else) started
        later; ``finished`` replaces "no rollout active" as the end of a bounded run.

        A replica's bounded run waits for the rollouts another replica holds: it takes them
        over if that one's lease expires, or sees them end there."""
        waiting: set[str] = set()
        for rid in rids or [r.id for r in self.store.rollouts(ROLLOUT_ACTIVE)]:
            if not self.take(rid):
                waiting.add(rid)
        ended_elsewhere: dict[str, str] = {}
        self.flush()
        last_scan = time.monotonic()
        while True:
            for msg in self.conn.receive(poll_s):
                if isinstance(msg.body, Result):
                    self.on_result(msg.device, msg.body)
                elif msg.kind == "status":
                    self.on_status(msg.device, msg.body if isinstance(msg.body, Status)
                                   else None)
            now = self.clock()
            if self.replica is not None:
                self._replica_turn(time.time())  # leases are wall-clock, shared with others
            for run in list(self.runs.values()):
                if run.rollout.state in ROLLOUT_ACTIVE:
                    self.tick(run, now)
            self.flush()
            if turn is not None:
                turn(now)
                self.flush()
            for run in self.runs.values():
                if self.on_progress is not None:
                    self.on_progress(run)
            if forever and time.monotonic() - last_scan > 1.0:
                last_scan = time.monotonic()
                for r in self.store.rollouts(ROLLOUT_ACTIVE):
                    self.take(r.id)
                if rescan is not None:
                    rescan()
            if waiting and time.monotonic() - last_scan > 1.0:
                last_scan = time.monotonic()
                for rid in sorted(waiting):
                    r = self.store.rollout(rid)
                    if r is None or r.state not in ROLLOUT_ACTIVE:
                        ended_elsewhere[rid] = r.state if r else "missing"
                        waiting.discard(rid)
                    elif self.take(rid):
                        waiting.discard(rid)
            done = finished() if finished is not None else not waiting and all(
                r.rollout.state not in ROLLOUT_ACTIVE for r in self.runs.values())
            if not forever and done:
                self.conn.flush()
                if self.replica is not None:
                    self.replica.release_all()
                return {**ended_elsewhere,
                        **{rid: r.rollout.state for rid, r in self.runs.items()}}

    def _replica_turn(self, now: float) -> None:
        """Keep our leases (drop what another replica took), release finished rollouts, and
        apply the results other replicas received for the rollouts we hold or have loaded."""
        assert self.replica is not None
        for rid in self.replica.renew(now):
            self.drop(rid)
        for rid, run in self.runs.items():
            if run.rollout.state not in ROLLOUT_ACTIVE and rid in self.replica.held:
                self.replica.release(rid)
        # Finished ones too: a late result still lands on its execution, as on one controller.
        for seq, device, result in self.replica.drain(self.runs):
            self.on_result(device, result)
            self._drained.append(seq)
