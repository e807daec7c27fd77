"""What the application's serving runtimes say, as the daemon's telemetry carries it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from agent.runtime.stats import ServingStats, read_stats
from contract import ServingInfo

MAX_MODELS = 64
"""Telemetry names at most this many served models (the contract's bound)."""


def serving_summary(state_dir: Path, max_age_s: float = 5.0) -> dict[str, ServingInfo] | None:
    """Per model: every fresh serving process's counts summed, the worst p99 (with its p50
    and SLO), the version the most processes serve; None when nothing serves."""
    by_model: dict[str, list[ServingStats]] = defaultdict(list)
    for s in read_stats(state_dir, max_age_s=max_age_s):
        by_model[s.model].append(s)
    if not by_model:
        return None
    out = {}
    for model in sorted(by_model)[:MAX_MODELS]:
        procs = by_model[model]
        served = [p for p in procs if p.p99_ms is not None]
        worst = max(served, key=lambda p: p.p99_ms or 0.0) if served else None
        versions = [p.version for p in procs]
        out[model] = ServingInfo(
            version=max(set(versions), key=versions.count), processes=len(procs),
            requests=sum(p.requests for p in procs), failed=sum(p.failed for p in procs),
            window_requests=sum(p.window_requests for p in procs),
            p50_ms=worst.p50_ms if worst else None, p99_ms=worst.p99_ms if worst else None,
            slo_ms=next((p.slo_ms for p in procs if p.slo_ms is not None), None))
    return out
