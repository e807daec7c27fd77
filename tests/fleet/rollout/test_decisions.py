"""The rollout's decisions, rule by rule: when it aborts itself (``fleet.rollout.abort``),
when a wave is finished and how a rollout ends (``fleet.rollout.verdict``), and whether an
ended execution runs again (``fleet.rollout.retry``). The controller acting on them is
``test_rollout.py``'s."""

from __future__ import annotations

from typing import Any

from fleet.rollout.abort import abort_on_failure_rate, abort_on_metric_drop, state_after_abort
from fleet.rollout.plan import RolloutPlan, validate_plan
from fleet.rollout.retry import will_retry
from fleet.rollout.run import Census
from fleet.rollout.store import Execution, Rollout, Wave
from fleet.rollout.verdict import (
    ended_as_asked,
    rollback_verdict,
    rollout_verdict,
    wave_baked,
    wave_finished,
)


def plan(**kw: Any) -> RolloutPlan:
    return validate_plan({"name": "r", "group": "g", "job": "deploy", **kw})


def execution(status: str = "SUCCEEDED", attempt: int = 1, before: float | None = None,
              after: float | None = None) -> Execution:
    return Execution("r-n.d.1", "r", "d", 0, "job", attempt, status, 0.0,
                     metric_before=before, metric_after=after)


def test_the_failure_rate_aborts_only_past_min_completed_and_above_the_rate() -> None:
    p = plan(abort_failure_rate=0.5, min_completed=4)
    assert abort_on_failure_rate(p, Census(done=3, failed=3)) is None  # too few done yet
    assert abort_on_failure_rate(p, Census(done=4, failed=2)) is None  # 0.5 is not above 0.5
    assert abort_on_failure_rate(p, Census(done=4, failed=3)) == "failure rate 3/4 > 0.5"


def test_a_wave_aborts_on_its_median_metric_drop_over_the_devices_that_reported_it() -> None:
    p = plan(abort_metric="eval/acc", max_metric_drop=0.02)
    small = [execution(before=0.9, after=0.89), execution(before=0.9, after=0.95),
             execution(before=0.9, after=0.5), execution()]  # the last reported no figure
    assert abort_on_metric_drop(p, 1, small) is None  # median drop 0.01
    big = [execution(before=0.9, after=0.8), execution(before=0.9, after=0.85),
           execution(before=0.9, after=0.95)]
    assert abort_on_metric_drop(p, 2, big) == "wave 2: median eval/acc drop 0.0500 > 0.02"
    assert abort_on_metric_drop(plan(), 2, big) is None  # no max_metric_drop: never
    assert abort_on_metric_drop(p, 2, [execution()]) is None  # no figure: nothing to judge


def test_after_an_abort_the_plan_says_whether_devices_roll_back() -> None:
    assert state_after_abort(plan(rollback_on_abort=True)) == "rolling_back"
    assert state_after_abort(plan(rollback_on_abort=False)) == "aborted"


def test_a_wave_is_finished_when_it_has_devices_and_none_unfinished() -> None:
    assert not wave_finished(Census(), 0)  # no device yet
    assert not wave_finished(Census(devices={0: 3}, unfinished={0: 1}), 0)
    assert wave_finished(Census(devices={0: 3}, unfinished={1: 2}), 0)
    baking = Wave("r", 0, 3, "baking", bake_until=100.0)
    assert not wave_baked(baking, 99.0) and wave_baked(baking, 100.0)
    assert not wave_baked(Wave("r", 0, 3, "running"), 100.0)


def test_how_a_rollout_ends() -> None:
    assert rollout_verdict(Census(failed_any=0)) == "succeeded"
    assert rollout_verdict(Census(failed_any=1)) == "completed_with_failures"
    r = Rollout("r", "n", plan(), "rolling_back", None, None, 0.0, 0.0, None)
    assert rollback_verdict(r) == "rolled_back"
    r.reason = "operator rollback"
    assert rollback_verdict(r) == "aborted"
    ok = {"waves": [{"failed": 0}], "rollback_failed": 0}
    assert ended_as_asked("succeeded", ok) and ended_as_asked("rolled_back", ok)
    assert not ended_as_asked("succeeded", {**ok, "waves": [{"failed": 1}]})
    assert not ended_as_asked("rolled_back", {**ok, "rollback_failed": 1})
    assert not ended_as_asked("completed_with_failures", ok)
    assert not ended_as_asked("aborted", ok)


def test_what_is_retried() -> None:
    p = plan(retries=1)
    for status in ("FAILED", "TIMED_OUT", "EXPIRED"):
        assert will_retry(p, "running", execution(status))
        assert will_retry(p, "paused", execution(status))
        assert not will_retry(p, "aborting", execution(status))  # an abort starts nothing
        assert not will_retry(p, "running", execution(status, attempt=2))  # retries spent
    for status in ("REJECTED", "SUCCEEDED", "CANCELED"):
        assert not will_retry(p, "running", execution(status))
    assert not will_retry(plan(), "running", execution("FAILED"))  # retries: 0
