"""When a wave is finished, and how a rollout ends.

A running wave is **finished** when every device of it has a final latest attempt
(``wave_finished``: succeeded or failed for good, no retry left); then the metric-drop rule
(``fleet.rollout.abort``) judges it, and a wave that passes bakes until ``bake_s`` is over
(``wave_baked``) before the next wave starts. A rollout whose waves are all done **ends**
``succeeded`` or ``completed_with_failures`` (``rollout_verdict``); one that was rolled back
ends ``rolled_back`` or ``aborted`` (``rollback_verdict``). ``ended_as_asked`` is what
``fleetctl`` exits 0 for.
"""

from __future__ import annotations

from typing import Any

from fleet.rollout.run import Census
from fleet.rollout.store import Rollout, Wave


def wave_finished(census: Census, wave: int) -> bool:
    """Wave ``wave`` has devices and none of their latest attempts is still open or to be
    retried."""
    return bool(census.devices.get(wave, 0)) and not census.unfinished.get(wave, 0)


def wave_baked(wave: Wave, now: float) -> bool:
    """A baking wave is done once its ``bake_until`` has passed (the failure-rate rule still
    watches the rollout while it bakes)."""
    return wave.state == "baking" and now >= (wave.bake_until or 0)


def rollout_verdict(census: Census) -> str:
    """A rollout whose every wave is done: ``completed_with_failures`` when any device's latest
    attempt failed (below the abort threshold), else ``succeeded``."""
    return "completed_with_failures" if census.failed_any else "succeeded"


def rollback_verdict(rollout: Rollout) -> str:
    """A rollout whose rollbacks are all over: ``aborted`` when it has a reason (it was aborted,
    by a rule or an operator's abort or rollback request), else ``rolled_back`` (a finished
    rollout rolled back on request)."""
    return "aborted" if rollout.reason else "rolled_back"


def ended_as_asked(state: str, summary: dict[str, Any]) -> bool:
    """What ``fleetctl`` exits 0 for: the rollout ``succeeded`` with no device failed in any
    wave, or was ``rolled_back`` (on request) with no rollback failed. ``summary`` is
    ``fleet.rollout.run.summarize``'s."""
    done = state == "succeeded" and not any(w["failed"] for w in summary["waves"])
    undone = state == "rolled_back" and summary["rollback_failed"] == 0
    return done or undone
