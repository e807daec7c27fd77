"""The rollout controller's loop with the learns' turn in it (``fleetctl learn run``,
``fleetctl controller --forever``): one ``Controller`` drives every active rollout of the db
and, after each of its turns, the learns (``fleet.learn.driver.LearnDriver``)."""

from __future__ import annotations

from collections.abc import Callable

from fleet.learn.driver import LearnDriver
from fleet.rollout.controller import Controller
from fleet.rollout.run import RolloutRun
from fleet.rollout.store import ROLLOUT_ACTIVE


def drive(ctl: Controller, driver: LearnDriver, learn_ids: list[str] | None, *,
          forever: bool = False, poll_s: float = 0.05,
          on_progress: Callable[[RolloutRun], None] | None = None) -> None:
    """The controller's loop with the learns' turn in it: every active rollout of the db is
    driven, and the given learns (None: every running one) until they end; ``forever`` also
    takes learns and rollouts started later. ``on_progress`` sees the rollouts that ran in
    this loop, once more at their end."""
    driver.select(learn_ids)
    seen: set[str] = set()

    def turn(now: float) -> None:
        driver.tick(now)
        if on_progress is None:
            return
        for run in ctl.runs.values():
            rid = run.rollout.id
            if run.rollout.state in ROLLOUT_ACTIVE:
                seen.add(rid)
                on_progress(run)
            elif rid in seen:
                seen.discard(rid)
                on_progress(run)

    ctl.run(None, forever=forever, poll_s=poll_s, turn=turn, rescan=driver.refresh,
            finished=driver.finished)
