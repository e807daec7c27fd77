"""When a round stops collecting device uploads: it aggregates as soon as ``min_updates``
devices' uploads are in (``has_quorum``; fresh ones and late ones within ``max_staleness``,
as ``fleet.learn.updates`` chose them), and it is skipped, its base kept for the next round,
when its fine-tune rollout ended or ``collect_s`` passed with fewer (``skip_reason``). Until
then it waits: an offline or slow device never holds a round, and what it uploads later
counts in a later one.

``hpc-train aggregate`` counts again what it could verify (signatures, lineage, finite
tensors): with fewer than ``min_updates`` usable it exits ``EXIT_TOO_FEW_UPDATES`` and the
round is skipped with the tool's reason (``aggregate_skip_reason``).
"""

from __future__ import annotations

from collections.abc import Sized

from fleet.learn.plan import LearnPlan

EXIT_TOO_FEW_UPDATES = 1
"""``hpc-train aggregate``: fewer usable updates than ``--min-updates`` (each skip and why in
its log)."""


def has_quorum(plan: LearnPlan, chosen: Sized) -> bool:
    """The round aggregates now: ``plan.min_updates`` devices' updates are chosen."""
    return len(chosen) >= plan.min_updates


def skip_reason(plan: LearnPlan, chosen: Sized, *, rollout_ended: bool, now: float,
                collect_until: float | None) -> str | None:
    """Why a round short of its quorum is skipped now: its fine-tune rollout ended (no more
    uploads will come from it), or ``collect_s`` is over (``collect_until``, set when the
    rollout started). None: it waits for more uploads."""
    if rollout_ended or now >= (collect_until or now):
        return (f"{len(chosen)} device upload(s) of the {plan.min_updates} needed "
                + ("when its fine-tune rollout ended" if rollout_ended
                   else f"within collect_s ({plan.collect_s:g} s)"))
    return None


def aggregate_skip_reason(code: int, output: str) -> str | None:
    """Why the round is skipped after ``hpc-train aggregate`` ended with ``code`` (its output's
    tail in ``output``): it found too few usable updates. None: any other end (0 is an
    aggregate; anything else an error that stops the learn)."""
    return f"hpc-train aggregate: {output}" if code == EXIT_TOO_FEW_UPDATES else None
