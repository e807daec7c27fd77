"""Baseline controllers that only the benchmarks and tests compare the governor against."""

from __future__ import annotations

from collections.abc import Sequence

from agent.pacing.controller import AppLatency, Decision, GovernorEvent, GovernorState, Phase
from agent.sensors.reading import Reading


class BangBangGovernor:
    """Run at full speed until the hottest zone reaches the target, then stop until it has
    cooled ``hysteresis_c`` below: what a cron job around jtop does. Baseline only."""

    def __init__(self, target_c: float, hysteresis_c: float = 2.0,
                 control_zones: Sequence[str] | None = None) -> None:
        self.target_c = target_c
        self.hysteresis_c = hysteresis_c
        self.control_zones = list(control_zones) if control_zones else None
        self.state = GovernorState.NORMAL
        self.events: list[GovernorEvent] = []

    def update(self, reading: Reading, now_s: float, phase: Phase = "active",
               latency: AppLatency | None = None) -> Decision:
        """A thermostat knows nothing of the application: ``latency`` is ignored."""
        hot = reading.hottest(self.control_zones)
        if hot is None:
            return Decision(1.0 if self.state == GovernorState.NORMAL else 0.0, self.state)
        zone, temp = hot
        if self.state == GovernorState.NORMAL and temp >= self.target_c:
            self.events.append(GovernorEvent(now_s, "state", "NORMAL", "THROTTLED",
                                             f"{zone} {temp:.1f} C >= {self.target_c:.1f} C"))
            self.state = GovernorState.THROTTLED
        elif self.state == GovernorState.THROTTLED and temp <= self.target_c - self.hysteresis_c:
            self.events.append(GovernorEvent(now_s, "state", "THROTTLED", "NORMAL",
                                             f"{zone} {temp:.1f} C cooled"))
            self.state = GovernorState.NORMAL
        duty = 1.0 if self.state == GovernorState.NORMAL else 0.0
        return Decision(duty, self.state, None if duty else "thermal", zone, temp,
                        reading.total_power_mw)
