"""The operator's rollout controls beyond waves and thresholds: a growing send rate, an
approval before each wave, devices that join the group during the rollout, and how often a
device may defer.

- **Rate** (``max_per_minute``, ``rate_increase``, ``rate_increase_after``, ``max_rate``): AWS
  IoT Jobs' exponential rollout. The rollout starts at ``max_per_minute`` (sends in any 60 s);
  each time another N devices were notified (sent the job) or succeeded since the last
  increase, the rate is multiplied by ``rate_increase``, at most once a minute (so the sends
  under the old rate never let a larger one through at once), up to ``max_rate``.
- **Approval** (``approve_waves``): a wave after the first starts only once an operator
  approved it (``fleetctl rollout approve``); until then the rollout is ``waiting_approval``.
- **Joiners** (``follow_group``): which wave a device that joined the group goes into.

What these decide lives in the rollout's ``controls`` (``fleet.rollout.store``), written
before anything they allow is sent, so a restarted controller or a replica taking over goes
on at the same rate with the same approvals. Each function here decides and sends nothing.
"""

from __future__ import annotations

from typing import Any

from fleet.rollout.plan import RolloutPlan
from fleet.rollout.store import Wave

RATE_STEP_S = 60.0
"""The rate grows at most once in this many seconds (its own unit: per minute)."""


def rate_limit(plan: RolloutPlan, controls: dict[str, Any]) -> int | None:
    """Sends allowed in any 60 s now; None: no limit."""
    if plan.max_per_minute is None:
        return None
    return max(1, int(controls.get("rate", plan.max_per_minute)))


def next_rate(plan: RolloutPlan, controls: dict[str, Any], counts: dict[str, int],
              now: float) -> dict[str, Any] | None:
    """The controls' rate part to store now, or None when it stays. ``counts``: devices
    ``notified`` (sent the job at least once) and ``succeeded`` so far.

    The first call of a rated rollout records the starting rate; later ones multiply it by
    ``rate_increase`` once ``RATE_STEP_S`` passed since the last change and the trigger's
    count grew by its N since then (the count at the change is kept as ``rate_mark``)."""
    if plan.max_per_minute is None:
        return None
    if "rate_at" not in controls:
        return {"rate": float(plan.max_per_minute), "rate_at": now, "rate_mark": 0}
    trigger = plan.rate_trigger()
    if trigger is None or plan.rate_increase is None or now - controls["rate_at"] < RATE_STEP_S:
        return None
    kind, n = trigger
    count = counts[kind]
    if count - int(controls.get("rate_mark", 0)) < n:
        return None
    rate = float(controls["rate"])
    ceiling = float(plan.max_rate) if plan.max_rate is not None else float("inf")
    if rate >= ceiling:
        return None
    return {"rate": min(ceiling, rate * plan.rate_increase), "rate_at": now, "rate_mark": count}


def approved(plan: RolloutPlan, controls: dict[str, Any], wave: int) -> bool:
    """May wave ``wave`` start? Always without ``approve_waves`` and for the first wave;
    otherwise once an operator approved it (or a later one)."""
    return not plan.approve_waves or wave == 0 or int(controls.get("approved", 0)) >= wave


def wave_for_joiner(waves: list[Wave]) -> int:
    """The wave a device that joined the group goes into: the first one not started yet, or
    the last one once every wave started (a joiner is never left out of a running rollout)."""
    pending = [w.idx for w in waves if w.state == "pending"]
    return pending[0] if pending else waves[-1].idx
