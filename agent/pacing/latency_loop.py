"""The governor's latency loop: training yields to the application's inference p99.

A PI controller holds the application's p99 (its serving runtime's report) at
``slo * (1 - margin)``; its error is relative to the SLO, so one set of gains serves a 2 ms and
a 200 ms objective. At ``min_duty`` and still over the SLO for ``yield_after_s``, training
yields completely (duty 0) until the p99 is back under the setpoint. No report (nobody
serving, or the runtime stopped writing) relaxes it to full duty: nothing to yield to. The
plant is fast (CPU and memory-bandwidth contention shows in the next window), so the gains
are fixed rather than derived from the thermal plant as the thermal loop's are.
"""

from __future__ import annotations

from agent.pacing.controller import AppLatency, PIController


class LatencyLoop:
    def __init__(self, *, slo_ms: float | None, margin: float, kp: float, ti_s: float,
                 min_duty: float, yield_after_s: float) -> None:
        self.configured_slo_ms = slo_ms
        self.margin = margin
        self.min_duty = min_duty
        self.yield_after_s = yield_after_s
        self.pi = PIController(kp, ti_s, min_duty, 1.0)
        self.pi.integral = 1.0  # full speed until the application says otherwise
        self.duty = 1.0
        """The loop's own duty (1.0 with no SLO or no report; 0.0 while yielding)."""
        self.yielding = False
        self.last_p99_ms: float | None = None
        self.slo_ms: float | None = None
        """The application's last reported p99 and the SLO it is held to."""
        self._error: float | None = None
        self._last_s: float | None = None
        self._over_at_min_since: float | None = None

    def update(self, latency: AppLatency | None, now: float) -> str | None:
        """Step on a report; returns the reason when training starts to yield completely."""
        slo = self.configured_slo_ms or (latency.slo_ms if latency is not None else None)
        if latency is None or slo is None:
            if self.yielding or self.duty < 1.0:
                self.yielding, self.duty, self.pi.integral = False, 1.0, 1.0
            self._error = self._last_s = self._over_at_min_since = None
            # Nothing is reported now: the samples say so rather than repeat the last p99.
            self.last_p99_ms = self.slo_ms = None
            return None
        self.last_p99_ms, self.slo_ms = latency.p99_ms, slo
        error = (slo * (1.0 - self.margin) - latency.p99_ms) / slo
        dt = 0.0 if self._last_s is None else now - self._last_s
        self._last_s, self._error = now, error
        loop_duty = self.pi.update(error, dt)
        started = None
        if latency.p99_ms > slo and loop_duty <= self.min_duty:
            if self._over_at_min_since is None:
                self._over_at_min_since = now
            if not self.yielding and now - self._over_at_min_since >= self.yield_after_s:
                self.yielding = True
                started = f"{self.why()} at duty {self.min_duty:.2f}: training yields"
        else:
            self._over_at_min_since = None
        if self.yielding and error >= 0:
            # Back under the setpoint: resume at the least duty, the loop climbs from there.
            self.yielding = False
            self.pi.track(self.min_duty, error)
            loop_duty = self.min_duty
        self.duty = 0.0 if self.yielding else loop_duty
        return started

    def track(self, applied: float) -> None:
        """Another limit set a lower duty: align so this loop resumes from it (bumpless) -
        only while the application is over the setpoint. Under it the loop asks for more than
        is applied and sits at full duty (its output is clipped, so nothing winds up); pulled
        down, it would ramp back slowly after every thermal dip and be named the limit while
        the application is well inside its SLO."""
        if (self._error is not None and self._error < 0 and not self.yielding
                and applied < self.duty):
            self.pi.track(applied, self._error)

    @property
    def constraining(self) -> bool:
        """The application is over the setpoint (or training yields to it)."""
        return self.yielding or (self._error is not None and self._error < 0)

    def why(self) -> str:
        if self.last_p99_ms is None or self.slo_ms is None:
            return "application latency"
        return f"application p99 {self.last_p99_ms:.1f} ms vs SLO {self.slo_ms:.1f} ms"
