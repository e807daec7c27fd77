"""Recent request latencies, for the p50/p99 a serving process reports about itself."""

from __future__ import annotations

import math
import time
from collections import deque

MAX_SAMPLES = 100_000
"""Held at most (~1.6 MB): at 10,000 requests a second the last 10 s; beyond that the window
is the most recent samples."""


class LatencyWindow:
    """A ring of (time.perf_counter(), ms); not thread-safe (its owner holds its lock around
    it). perf_counter, not monotonic: the request path has just read it."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._ring: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, ms: float, now: float | None = None) -> None:
        self._ring.append((time.perf_counter() if now is None else now, ms))

    def recent(self, window_s: float, now: float | None = None) -> list[float]:
        """The latencies (ms) of the last ``window_s`` seconds, oldest first: a copy, so the
        owner sorts it for :func:`percentiles` after releasing its lock (a sort of 100,000
        samples under it would stall every request for milliseconds)."""
        since = (time.perf_counter() if now is None else now) - window_s
        ring = self._ring
        while ring and ring[0][0] < since:  # drop what left the window: the ring stays short
            ring.popleft()
        return [ms for _, ms in ring]


def percentiles(samples: list[float]) -> tuple[float | None, float | None, int]:
    """(p50, p99, count) of ``samples`` (nearest rank); (None, None, 0) when there are none."""
    xs = sorted(samples)
    if not xs:
        return None, None, 0

    def rank(q: float) -> float:
        return xs[max(0, math.ceil(q * len(xs)) - 1)]

    return rank(0.50), rank(0.99), len(xs)
