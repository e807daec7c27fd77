"""When a rollout aborts itself, and what follows an abort.

Two rules of the plan stop a rollout on their own (an operator's ``fleetctl rollout abort``
or ``rollback`` is the other way):

- **Failure rate** (``abort_on_failure_rate``), checked every turn while the rollout runs or
  is paused: once ``min_completed`` devices are done, more than ``abort_failure_rate`` of
  them failed for good.
- **Metric drop** (``abort_on_metric_drop``), checked once per wave, when its last device is
  done: the median drop of the plan's ``abort_metric`` over the wave's devices exceeds
  ``max_metric_drop``. By default that is each device's own gate metric (``gate``: top-1
  accuracy of a classifier, mAP of a detector, as its JobOutcome names it): the rule reads
  the task's figure without knowing the task. A wave that passes bakes for ``bake_s``, then
  the next one starts.

Each returns the reason the rollout records (``fleetctl rollout status`` shows it), or None
while the rollout goes on. An abort (``Controller.abort``) starts no new wave, drops what was
not sent and cancels what waits on a device; the jobs already running finish, and then
``state_after_abort`` says where the rollout goes.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from fleet.rollout.plan import GATE_METRIC, RolloutPlan, abort_metric_of
from fleet.rollout.run import Census
from fleet.rollout.store import Execution


def abort_on_failure_rate(plan: RolloutPlan, census: Census) -> str | None:
    """The rollout aborts when at least ``plan.min_completed`` devices are done (their latest
    attempt final and not canceled) and more than ``plan.abort_failure_rate`` of those failed
    (``failure rate 3/5 > 0.5``); None: it goes on."""
    done, failed = census.done, census.failed
    if done >= plan.min_completed and failed / done > plan.abort_failure_rate:
        return f"failure rate {failed}/{done} > {plan.abort_failure_rate:g}"
    return None


def abort_on_metric_drop(plan: RolloutPlan, wave: int,
                         executions: Iterable[Execution]) -> str | None:
    """A finished wave aborts the rollout when the median drop (before - after) of the plan's
    ``abort_metric`` over its devices' latest attempts exceeds ``plan.max_metric_drop``;
    devices that reported no figure before and after do not count. None: the wave passes
    (also when the plan sets no ``max_metric_drop`` or no device reported the metric)."""
    reported = [e for e in executions
                if e.metric_before is not None and e.metric_after is not None]
    drops = [e.metric_before - e.metric_after for e in reported]  # type: ignore[operator]
    if plan.max_metric_drop is None or not drops:
        return None
    med = statistics.median(drops)
    if med <= plan.max_metric_drop:
        return None
    # ``gate`` is each device's own gate metric: say which ones the figures were.
    names = sorted({abort_metric_of(plan.abort_metric or GATE_METRIC, _gate_metric(e))
                    for e in reported})
    return (f"wave {wave}: median {'/'.join(names)} drop {med:.4f} > "
            f"{plan.max_metric_drop:g}")


def _gate_metric(e: Execution) -> str | None:
    """The gate metric the device's JobOutcome named (its result is the device's JSON)."""
    name = (e.result or {}).get("gate_metric")
    return name if isinstance(name, str) else None


def state_after_abort(plan: RolloutPlan) -> str:
    """Once no job of an aborting rollout runs any more: ``rolling_back`` (every device that
    committed the new model is sent a rollback) when ``plan.rollback_on_abort``, else
    ``aborted`` (the devices keep what they have)."""
    return "rolling_back" if plan.rollback_on_abort else "aborted"
