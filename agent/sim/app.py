"""An application sharing the board with training, to test yielding against in simulated time.

The application serves inference on the cores training uses. Its p99 grows with the share of
the last ``window_s`` seconds that training spent computing: ``p99 = base * (1 + slowdown *
share) + bursts``, where a step that left the application's cores alone (training on fewer
threads, ``contention`` < 1) counts for that share of its time. That is the first-order picture
of CPU and memory-bandwidth contention (on a 2-core x86 box, ``benchmarks/runtime.py``'s
co-running section measures the real curve); a burst stands for load the governor cannot remove
(the application's own), and times are simulated seconds, so a burst ends while training waits.
"""

from __future__ import annotations

from collections import deque

from agent.pacing.controller import AppLatency


class ContendedApp:
    def __init__(self, *, base_p99_ms: float, slowdown: float, slo_ms: float | None = None,
                 window_s: float = 5.0) -> None:
        self.base_p99_ms = base_p99_ms
        self.slowdown = slowdown
        self.slo_ms = slo_ms
        self.window_s = window_s
        self.bursts: list[tuple[float, float, float]] = []  # (start s, end s, extra ms)
        self.stops_serving_s = float("inf")
        self._busy: deque[tuple[float, float]] = deque()  # (end time, seconds computing)
        self.now_s = 0.0

    def burst(self, start_s: float, end_s: float, extra_ms: float) -> None:
        self.bursts.append((start_s, end_s, extra_ms))

    def trained(self, end_s: float, seconds: float, contention: float = 1.0) -> None:
        """Training computed for ``seconds`` up to ``end_s``, taking ``contention`` of the
        application's cores (1: all of them)."""
        self._busy.append((end_s, seconds * contention))
        self.now_s = max(self.now_s, end_s)

    def share(self, now_s: float) -> float:
        """Share of the last window training computed."""
        start = now_s - self.window_s
        while self._busy and self._busy[0][0] <= start:
            self._busy.popleft()
        busy = sum(min(d, end - start) for end, d in self._busy if end > start)
        return min(1.0, busy / self.window_s)

    def p99_ms(self, now_s: float) -> float:
        extra = sum(ms for start, end, ms in self.bursts if start <= now_s < end)
        return self.base_p99_ms * (1.0 + self.slowdown * self.share(now_s)) + extra

    def report(self, now_s: float) -> AppLatency | None:
        """What the serving runtime would say now; None when the application is not serving."""
        if now_s >= self.stops_serving_s:
            return None
        return AppLatency(self.p99_ms(now_s), self.slo_ms)
