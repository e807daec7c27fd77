"""What keeps a controller turn's cost independent of a rollout's size: per rollout, the
executions waiting to be sent (in plan order), three heaps of deadlines (the timeout of each
sent execution, the next time to ask an execution nothing was heard of again, the time a
deferred one goes again), and a
``Census`` of the latest attempts recounted only when something changed and at most as often
as its own cost allows (10x its duration apart, so counting never takes more than a tenth of
the controller's time; a small rollout is recounted at once).

A turn then touches what is due or what changed, not every execution: a 10,000-device
rollout costs the same per device as a 1,000-device one (``benchmarks/fleet.py --scale``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from fleet.rollout.run import Census, RolloutRun
from fleet.rollout.store import Execution

MAX_RECOUNT_S = 0.25
"""The longest a decision waits for a recount (a wave's end, the failure rate)."""


@dataclass
class Schedule:
    planned: deque[str] = field(default_factory=deque)
    """Job executions PLANNED, oldest first (those no longer PLANNED are skipped)."""
    deadlines: list[tuple[float, str]] = field(default_factory=list)
    asks: list[tuple[float, str]] = field(default_factory=list)
    rechecks: list[tuple[float, str]] = field(default_factory=list)
    """DEFERRED executions by the time their device asked to be sent them again."""
    counted: Census | None = None
    counted_at: float = 0.0
    changed: bool = True

    def plan(self, e: Execution) -> None:
        if e.kind == "job":
            self.planned.append(e.id)

    def sent(self, e: Execution, timeout_s: float, reask_s: float) -> None:
        """``e`` went out (or was re-sent on load): when it times out, when to ask again."""
        assert e.sent_at is not None
        heapq.heappush(self.deadlines, (e.sent_at + timeout_s, e.id))
        heapq.heappush(self.asks, (e.sent_at + reask_s, e.id))

    def due(self, heap: list[tuple[float, str]], now: float) -> Iterator[str]:
        """Pop the ids whose time has come (the caller re-checks each: it may be done)."""
        while heap and heap[0][0] < now:
            yield heapq.heappop(heap)[1]

    def recheck(self, e: Execution) -> None:
        """``e`` was DEFERRED: send it again at its ``recheck_at``."""
        assert e.recheck_at is not None
        heapq.heappush(self.rechecks, (e.recheck_at, e.id))

    def ask_later(self, at: float, eid: str) -> None:
        heapq.heappush(self.asks, (at, eid))

    def census(self, run: RolloutRun, now: float) -> Census:
        c = self.counted
        if c is None or (self.changed and now - self.counted_at >= min(
                MAX_RECOUNT_S, 10 * c.took_s)):
            c = self.counted = run.census()
            self.counted_at, self.changed = now, False
        return c
