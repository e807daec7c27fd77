"""The pieces every pacing controller shares: its decision, its states and events, the clock.

The knob is the training duty cycle: the share of wall time spent computing, set by sleeping
between optimizer steps (``pause = step_time * (1 - duty) / duty``). The clock is injected
(``Clock``), so tests run hours of simulated time in seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Protocol

from agent.sensors.reading import Reading

Phase = Literal["active", "idle"]
"""A reading taken right after a step (the board was computing) or after a pause (idle)."""


class GovernorState(str, Enum):
    NORMAL = "NORMAL"
    THROTTLED = "THROTTLED"
    PAUSED = "PAUSED"


@dataclass(frozen=True)
class GovernorEvent:
    t_s: float
    kind: Literal["state", "power_mode", "sensor"]
    old: str
    new: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"t_s": self.t_s, "kind": self.kind, "old": self.old, "new": self.new,
                "reason": self.reason}


@dataclass(frozen=True)
class AppLatency:
    """The application's inference latency, as its serving runtime reports it."""

    p99_ms: float
    """Over the runtime's last window."""
    slo_ms: float | None = None
    """The objective the application states (the governor's own setting wins)."""


@dataclass(frozen=True)
class Decision:
    duty: float
    """Share of time to compute, 0..1; 0 = do not start another step yet."""
    state: GovernorState
    limit: str | None = None
    """Which limit sets the duty: "thermal", "power", "sensor", "latency" (the application's
    p99 is over its SLO: training yields), or None at full speed."""
    zone: str | None = None
    temp_c: float | None = None
    power_mw: float | None = None


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class DutyController(Protocol):
    """What ``GovernorHook`` drives: the PI ``Governor`` or the ``BangBangGovernor``."""

    state: GovernorState
    events: list[GovernorEvent]
    target_c: float

    def update(self, reading: Reading, now_s: float, phase: Phase = "active",
               latency: AppLatency | None = None) -> Decision: ...


class PIController:
    """u = Kp * e + I, clipped to [lo, hi]; I accumulates Kp * e * dt / Ti.

    Anti-windup: I stays within [lo, hi] and integrates only while the output is not clipped
    (or the error pulls it back inside), so a long stretch at full speed on a cool board leaves
    nothing to unwind when the target is reached. ``track`` realigns I when another limit set
    the output (bumpless hand-over)."""

    def __init__(self, kp: float, ti_s: float, lo: float, hi: float) -> None:
        self.kp, self.ti_s, self.lo, self.hi = kp, ti_s, lo, hi
        self.integral = 0.0
        """In output units (duty)."""

    def _clip(self, x: float) -> float:
        return min(self.hi, max(self.lo, x))

    def update(self, error: float, dt_s: float) -> float:
        raw = self.kp * error + self.integral
        saturated_high = raw >= self.hi and error > 0
        saturated_low = raw <= self.lo and error < 0
        if not (saturated_high or saturated_low):
            self.integral = self._clip(self.integral + self.kp * error * dt_s / self.ti_s)
        return self._clip(self.kp * error + self.integral)

    def track(self, applied: float, error: float) -> None:
        """Another limit set the output: align so this loop resumes from the applied duty."""
        self.integral = self._clip(applied - self.kp * error)
