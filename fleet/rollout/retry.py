"""Whether an ended execution runs again.

A device's job that ended FAILED, TIMED_OUT or EXPIRED is tried again (attempt + 1, the
same device and wave, a new execution id) while the plan's ``retries`` last and the rollout
still runs, is paused or waits for an approval; REJECTED never is (its args are wrong: a retry
would be refused the same way), nor a job that SUCCEEDED or was CANCELED, nor one that failed
because its device deferred it more than ``max_defers`` times (a retry would only give the
device as many deferrals again: ``max_defers`` is the bound). An execution that will not run
again is final (``RolloutRun.final``): what the failure rate, a wave's end and the summaries
count.
"""

from __future__ import annotations

from fleet.rollout.plan import RolloutPlan
from fleet.rollout.store import DEFERRED_TOO_OFTEN, ROLLOUT_GOING, Execution

RETRIED = frozenset({"FAILED", "TIMED_OUT", "EXPIRED"})
"""Terminal statuses a plan's ``retries`` apply to; REJECTED never is (the args are wrong)."""


def will_retry(plan: RolloutPlan, rollout_state: str, e: Execution) -> bool:
    """Ended execution ``e`` runs again: it ended in one of ``RETRIED``, it was attempt
    ``plan.retries`` or earlier (``retries: 1`` gives two attempts), not past ``max_defers``,
    and the rollout is ``running``, ``paused`` or ``waiting_approval`` (an aborting one starts
    nothing)."""
    return (e.status in RETRIED and e.attempt <= plan.retries
            and e.error_code != DEFERRED_TOO_OFTEN and rollout_state in ROLLOUT_GOING)
