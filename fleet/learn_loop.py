"""The rollout controller's loop with the learns' turn in it (``fleetctl learn run``): one
``Controller`` drives every active rollout of the db and, after each of its turns, the
learns (``fleet.learn.LearnDriver``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from contract import Result
from fleet.controller import Controller
from fleet.learn import LearnDriver
from fleet.rollout_run import RolloutRun
from fleet.store import ROLLOUT_ACTIVE


def drive(ctl: Controller, driver: LearnDriver, learn_ids: list[str] | None, *,
          forever: bool = False, poll_s: float = 0.05,
          on_progress: Callable[[RolloutRun], None] | None = None) -> None:
    """The controller's loop (messages in -> rollouts -> sends out) with the learns' turn in
    it: every active rollout of the db is driven, and the given learns (None: every running
    one) until they end; ``forever`` also takes learns and rollouts started later."""
    for r in ctl.store.rollouts(ROLLOUT_ACTIVE):
        if r.id not in ctl.runs:
            ctl.load(r.id)
    driver.select(learn_ids)
    ctl.flush()
    seen: set[str] = set()
    last_scan = time.monotonic()
    while True:
        for msg in ctl.conn.receive(poll_s):
            if isinstance(msg.body, Result):
                ctl.on_result(msg.device, msg.body)
        now = time.time()
        for run in list(ctl.runs.values()):
            if run.rollout.state in ROLLOUT_ACTIVE:
                ctl.tick(run, now)
        ctl.flush()
        driver.tick(now)
        ctl.flush()
        if on_progress is not None:  # the rollouts that ran in this loop, once more at their end
            for run in ctl.runs.values():
                rid = run.rollout.id
                if run.rollout.state in ROLLOUT_ACTIVE:
                    seen.add(rid)
                    on_progress(run)
                elif rid in seen:
                    seen.discard(rid)
                    on_progress(run)
        if forever and time.monotonic() - last_scan > 1.0:
            last_scan = time.monotonic()
            for r in ctl.store.rollouts(ROLLOUT_ACTIVE):
                if r.id not in ctl.runs:
                    ctl.load(r.id)
            driver.refresh()
        if not forever and driver.finished():
            ctl.conn.flush()
            return
