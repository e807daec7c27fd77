"""The suite's scheduler: ``--dist loadfile`` with one test process kept for the files that
mostly wait.

``make test`` is CPU-bound on a 2-core host, and a file that mostly waits (a Ray cluster's
start, Slurm's daemons, a broker's or a server's timeouts, simulated devices' paced jobs)
holds a test process for its whole wall time while it leaves the cores idle. Handed out among
the CPU-bound files, each such file took one of the three processes out of the work, and
where two met, a core idled (1.2-1.6 cores busy for minutes of a clean-clone run: the
``CPU_REPORT_JSON`` spans). So with three test processes or more, the last one (the highest
``gwN``) is a lane of its own: it runs only the waiting files, one after another, beside the
CPU-bound files the others run, which keep both cores busy. A CPU-bound process that finds no
CPU-bound file left takes a waiting file that has not started; the waiting lane stops when
its files are all taken. With fewer processes every process takes every kind of file in
order, as ``--dist loadfile`` does.
"""

from __future__ import annotations

from collections.abc import Collection

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

MIN_PROCESSES = 3
"""Processes a run needs for one of them to become the waiting lane: two CPU-bound ones at
least, one for each core."""


class WaitingLaneScheduling(LoadFileScheduling):
    """``--dist loadfile`` (each file's tests in one process, files handed out in collection
    order as processes free up) with the last process kept for the files in ``waiting``."""

    def __init__(self, config: pytest.Config, log: Producer | None = None, *,
                 waiting: Collection[str]) -> None:
        super().__init__(config, log)
        self.waiting = frozenset(waiting)

    def _is_lane(self, node: WorkerController) -> bool:
        # By the run's process count and the node's name, not by the nodes still up: once the
        # lane has stopped, the highest CPU-bound process must not become a lane in its turn.
        return self.numnodes >= MIN_PROCESSES and node.gateway.id == f"gw{self.numnodes - 1}"

    def _next_file(self, node: WorkerController) -> str | None:
        """The file ``node`` runs next: the first of its kind in the queue; for a CPU-bound
        process with none of its kind left, the first waiting file; None for the lane."""
        lane = self._is_lane(node)
        mine = next((f for f in self.workqueue if (f in self.waiting) is lane), None)
        if mine is None and not lane:
            return next(iter(self.workqueue), None)
        return mine

    def _assign_work_unit(self, node: WorkerController) -> None:
        scope = self._next_file(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid)
                                for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if self._next_file(node) is None:  # nothing left of the kinds it takes
            node.shutdown()
            return
        # As xdist's own: the next file once two or fewer of the node's tests are pending.
        if self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
