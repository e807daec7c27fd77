"""The application's latency as the governor reads it: the serving runtimes' stats files.

Each process serving the model writes its window's p99 (``agent.runtime.stats``); the worst
of the fresh ones is what training yields to. Read at most every ``every_s`` (a glob and a
few small JSON files): optimizer steps can be milliseconds apart.
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agent.pacing.controller import AppLatency
from agent.runtime.stats import read_stats, worst_p99


class AppLatencySource(BaseModel):
    """Where the job finds the application's latency: the device decides, never a command."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state_dir: Path
    """The device's state dir (its runtime/ folder holds the serving processes' stats)."""
    model: str
    slo_ms: float | None = Field(default=None, gt=0)
    """The device's SLO for the application's p99 (null: the one the application states)."""
    max_age_s: float = Field(default=5.0, gt=0)
    """A stats file older than this is a process that stopped serving."""


class RuntimeLatency:
    """Callable for ``GovernorHook(latency=...)``: the worst fresh report, or None."""

    def __init__(self, source: AppLatencySource, every_s: float = 0.5) -> None:
        self.source = source
        self.every_s = every_s
        self._at = -float("inf")
        self._last: AppLatency | None = None

    def __call__(self) -> AppLatency | None:
        now = time.monotonic()
        if now - self._at >= self.every_s:
            self._at = now
            worst = worst_p99(read_stats(self.source.state_dir, self.source.model,
                                         max_age_s=self.source.max_age_s))
            self._last = None if worst is None or worst.p99_ms is None else AppLatency(
                worst.p99_ms, self.source.slo_ms or worst.slo_ms)
        return self._last
