"""Pace training so the board stays under its thermal target and power cap.

The knob is the training duty cycle: the share of wall time spent computing, set by sleeping
between optimizer steps (``pause = step_time * (1 - duty) / duty``). Average power is
``idle + duty * (active - idle)`` and the board's temperature follows it with the heat sink's
time constant, so duty is a smooth, fast actuator for a slow, first-order plant.

- Thermal loop: a PI controller on the hottest zone, setpoint ``target - margin``, gains from
  the profile's plant estimate (SIMC/IMC rules: Kp = tau / (K * lambda), Ti = min(tau,
  4 * lambda)). Anti-windup by integrator tracking: whenever the output is clipped, or another
  limit is in charge, the integrator is reset so its output equals the duty actually applied.
- Power limit: the average power of a duty cycle is predicted from measured active power (read
  right after a step) and idle power (read after a pause): duty = (cap - idle) / (active - idle).
- States NORMAL (full speed) / THROTTLED (a limit is active) / PAUSED (at the soft limit: the
  caller checkpoints and waits until the hottest zone is below ``resume_below_c``). Every state
  change and power-mode switch is a ``GovernorEvent`` with its reason.
- Optional power-mode switching: when throttled, a lower-clocked mode can deliver more steps
  per second inside the same power envelope (voltage falls with frequency); switches are rare
  (``mode_switch_every_s``) and need a predicted gain of ``mode_switch_min_gain``.

``GovernorHook`` plugs all this into ``hpc_core.Trainer`` as a ``TrainerHook``. The clock is
injected (``Clock``), so tests run hours of simulated time in seconds. ``BangBangGovernor`` is
the thermostat baseline the benchmark compares against.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.sensors import SensorBackend
from agent.sensors.reading import Reading
from device_profiles.schema import DeviceProfile

log = logging.getLogger("agent.governor")

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
class Decision:
    duty: float
    """Share of time to compute, 0..1; 0 = do not start another step yet."""
    state: GovernorState
    limit: str | None = None
    """Which limit sets the duty: "thermal", "power", "sensor", or None at full speed."""
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

    def update(self, reading: Reading, now_s: float, phase: Phase = "active") -> Decision: ...


class PowerModeSwitcher(Protocol):
    def current(self) -> str | None: ...

    def available(self) -> list[str]: ...

    def switch(self, name: str) -> None: ...


# ---------------------------------------------------------------------------------------------
# Configuration


class GovernorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target_c: float
    """Keep the hottest zone at or below this (the profile's throttle_target_c)."""
    soft_pause_c: float
    """Pause (and checkpoint) at or above this."""
    resume_below_c: float
    """Resume a paused job once the hottest zone is below this."""
    control_zones: list[str] | None = None
    """Zones to regulate; None = hottest die zone."""
    setpoint_margin_c: float = Field(default=0.5, ge=0)
    """The PI aims this far below target_c, so sensor noise does not push it over."""
    kp_per_c: float = Field(gt=0)
    """Proportional gain: duty per C of error."""
    ti_s: float = Field(gt=0)
    """Integral time: the integrator adds kp_per_c * error every ti_s seconds."""
    min_duty: float = Field(default=0.05, gt=0, le=1)
    """Lowest duty while running (below it the job would barely move; PAUSED stops it)."""
    power_cap_mw: float | None = Field(default=None, gt=0)
    """Average board power cap (None = only the power mode's own budget)."""
    idle_power_mw: float = Field(gt=0)
    """Idle power until one is measured (the profile's estimate)."""
    throttled_below_duty: float = Field(default=0.97, gt=0, le=1)
    """Enter THROTTLED when the duty drops below this..."""
    normal_after_s: float = Field(default=10.0, ge=0)
    """...and go back to NORMAL after this long at full duty (no chatter on sensor noise)."""
    sensor_timeout_s: float = Field(default=30.0, gt=0)
    """Without a temperature for this long, fall back to fallback_duty."""
    fallback_duty: float = Field(default=0.5, gt=0, le=1)
    allow_mode_switch: bool = False
    """The job allows switching nvpmodel power modes."""
    mode_switch_every_s: float = Field(default=300.0, gt=0)
    mode_switch_min_gain: float = Field(default=0.10, ge=0)
    """Switch only for at least this relative gain in predicted steps/s."""
    thermal_resistance_c_per_w: float = Field(gt=0)
    """Plant estimate used to predict headroom when deciding a switch to a faster mode."""

    @model_validator(mode="after")
    def _check(self) -> GovernorConfig:
        if not self.target_c <= self.resume_below_c < self.soft_pause_c:
            raise ValueError(
                "need target_c <= resume_below_c < soft_pause_c, got "
                f"{self.target_c}, {self.resume_below_c}, {self.soft_pause_c}"
            )
        return self

    @classmethod
    def from_profile(
        cls,
        profile: DeviceProfile,
        *,
        mode: str | None = None,
        closed_loop_s: float = 60.0,
        **overrides: Any,
    ) -> GovernorConfig:
        """Limits from the profile; PI gains by the SIMC rules from its plant estimate:
        static gain K = R * (P_train - P_idle) C per unit duty, time constant tau = R * C,
        Kp = tau / (K * lambda), Ti = min(tau, 4 * lambda) with lambda = closed_loop_s."""
        p, t = profile.plant, profile.thermal
        k = p.thermal_resistance_c_per_w * (profile.load_power_w(mode) - p.idle_power_w)
        tau = p.thermal_resistance_c_per_w * p.heat_capacity_j_per_c
        values: dict[str, Any] = {
            "target_c": t.throttle_target_c,
            "soft_pause_c": t.soft_pause_c,
            "resume_below_c": t.resume_below_c,
            "control_zones": t.control_zones,
            "kp_per_c": tau / (k * closed_loop_s),
            "ti_s": min(tau, 4.0 * closed_loop_s),
            "idle_power_mw": p.idle_power_w * 1000.0,
            "thermal_resistance_c_per_w": p.thermal_resistance_c_per_w,
        }
        values.update(overrides)
        return cls(**values)


# ---------------------------------------------------------------------------------------------
# The PI governor


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


@dataclass
class _PowerEstimate:
    """EMA of power right after steps (active) and after pauses (idle)."""

    active_mw: float | None = None
    idle_mw: float | None = None
    alpha: float = 0.3

    def add(self, phase: Phase, mw: float) -> None:
        attr = "active_mw" if phase == "active" else "idle_mw"
        old = getattr(self, attr)
        setattr(self, attr, mw if old is None else old + self.alpha * (mw - old))


class Governor:
    def __init__(
        self,
        cfg: GovernorConfig,
        *,
        profile: DeviceProfile | None = None,
        switcher: PowerModeSwitcher | None = None,
    ) -> None:
        if cfg.allow_mode_switch and (profile is None or switcher is None):
            raise ValueError("allow_mode_switch needs the device profile and a mode switcher")
        self.cfg = cfg
        self.profile = profile
        self.switcher = switcher
        self.target_c = cfg.target_c
        self.pi = PIController(cfg.kp_per_c, cfg.ti_s, cfg.min_duty, 1.0)
        self.power = _PowerEstimate(idle_mw=None)
        self.state = GovernorState.NORMAL
        self.duty = 1.0
        self.limit: str | None = None
        self.events: list[GovernorEvent] = []
        self._last_active_s: float | None = None
        self._last_temp_s: float | None = None
        self._sensor_lost = False
        self._last_switch_s: float | None = None
        self._full_since: float | None = None
        self._seen_temperature = False
        self._no_sensor_since: float | None = None

    # -- helpers --------------------------------------------------------------------------------

    def _event(self, now: float, kind: str, old: str, new: str, reason: str) -> None:
        ev = GovernorEvent(now, kind, old, new, reason)  # type: ignore[arg-type]
        self.events.append(ev)
        log.info("governor %s: %s -> %s (%s)", kind, old, new, reason)

    def _set_state(self, now: float, new: GovernorState, reason: str) -> None:
        if new != self.state:
            self._event(now, "state", self.state.value, new.value, reason)
            self.state = new

    def _idle_mw(self) -> float:
        return self.power.idle_mw if self.power.idle_mw is not None else self.cfg.idle_power_mw

    def _power_duty(self) -> float:
        cap, active = self.cfg.power_cap_mw, self.power.active_mw
        if cap is None or active is None or active <= cap:
            return 1.0
        idle = self._idle_mw()
        if active <= idle:
            return 1.0
        return max(self.cfg.min_duty, min(1.0, (cap - idle) / (active - idle)))

    # -- the update -----------------------------------------------------------------------------

    def update(self, reading: Reading, now_s: float, phase: Phase = "active") -> Decision:
        if reading.total_power_mw is not None:
            self.power.add(phase, reading.total_power_mw)
        hot = reading.hottest(self.cfg.control_zones)
        if hot is None:
            return self._no_temperature(now_s, reading)
        zone, temp = hot
        self._last_temp_s = now_s
        self._seen_temperature = True
        if self._sensor_lost:
            self._sensor_lost = False
            self._event(now_s, "sensor", "lost", "ok", f"temperatures back ({zone} {temp:.1f} C)")

        if self.state == GovernorState.PAUSED:
            if temp >= self.cfg.resume_below_c:
                return self._decision(0.0, zone, temp, reading)
            # Resume cautiously: from the duty that tracks the current error, not full speed.
            self.pi.track(self.cfg.min_duty, self.cfg.target_c - self.cfg.setpoint_margin_c - temp)
            self.duty = self.cfg.min_duty
            self._set_state(
                now_s, GovernorState.THROTTLED,
                f"{zone} {temp:.1f} C below resume point {self.cfg.resume_below_c:.1f} C",
            )
        if temp >= self.cfg.soft_pause_c:
            self._set_state(now_s, GovernorState.PAUSED,
                            f"{zone} {temp:.1f} C at soft limit {self.cfg.soft_pause_c:.1f} C: "
                            "checkpoint and wait")
            self.duty, self.limit = 0.0, "thermal"
            return self._decision(0.0, zone, temp, reading)
        if phase == "idle":
            return self._decision(self.duty, zone, temp, reading)

        dt = 0.0 if self._last_active_s is None else now_s - self._last_active_s
        self._last_active_s = now_s
        error = self.cfg.target_c - self.cfg.setpoint_margin_c - temp
        thermal = self.pi.update(error, dt)
        power = self._power_duty()
        duty = min(thermal, power)
        if power < thermal:
            self.pi.track(duty, error)
        self.limit = None if duty >= 1.0 else ("power" if power < thermal else "thermal")
        self.duty = duty
        self._update_state(now_s, zone, temp)
        if self.cfg.allow_mode_switch:
            self._maybe_switch_mode(now_s, temp, error)
        return self._decision(self.duty, zone, temp, reading)

    def _update_state(self, now: float, zone: str, temp: float) -> None:
        if self.duty < 1.0:
            self._full_since = None
        elif self._full_since is None:
            self._full_since = now
        if self.state == GovernorState.NORMAL and self.duty < self.cfg.throttled_below_duty:
            if self.limit == "power":
                watts = (self.power.active_mw or 0.0) / 1000
                cap = (self.cfg.power_cap_mw or 0.0) / 1000
                why = f"power {watts:.1f} W over cap {cap:.1f} W"
            else:
                why = f"{zone} {temp:.1f} C approaching target {self.cfg.target_c:.1f} C"
            self._set_state(now, GovernorState.THROTTLED, f"{why}: duty {self.duty:.2f}")
        elif (
            self.state == GovernorState.THROTTLED
            and self._full_since is not None
            and now - self._full_since >= self.cfg.normal_after_s
        ):
            self._set_state(now, GovernorState.NORMAL, f"{zone} {temp:.1f} C: headroom, full speed")

    def _no_temperature(self, now: float, reading: Reading) -> Decision:
        if not self._seen_temperature:
            # A machine without thermal sensors (a container, some x86 boxes): nothing to
            # regulate against, so thermal pacing is off; said once, the power cap still holds.
            if self._no_sensor_since is None:
                self._no_sensor_since = now
            elif not self._sensor_lost and now - self._no_sensor_since >= self.cfg.sensor_timeout_s:
                self._sensor_lost = True  # only to say it once
                self._event(now, "sensor", "none", "none",
                            "no temperature sensor on this machine: thermal pacing off")
            if self.cfg.power_cap_mw is not None:
                self.duty = self._power_duty()
                self.limit = "power" if self.duty < 1.0 else None
            return self._decision(self.duty, None, None, reading)
        last = self._last_temp_s
        assert last is not None
        if not self._sensor_lost and now - last >= self.cfg.sensor_timeout_s:
            self._sensor_lost = True
            self._event(now, "sensor", "ok", "lost",
                        f"no temperature for {now - last:.0f} s: duty at most "
                        f"{self.cfg.fallback_duty:.2f}")
        if self._sensor_lost and self.state != GovernorState.PAUSED:
            self.duty = min(self.duty, self.cfg.fallback_duty)
            self.limit = "sensor"
            self._full_since = None
            if self.state == GovernorState.NORMAL:
                self._set_state(now, GovernorState.THROTTLED, "temperature sensors lost")
        return self._decision(self.duty, None, None, reading)

    def _decision(self, duty: float, zone: str | None, temp: float | None,
                  reading: Reading) -> Decision:
        return Decision(duty, self.state, self.limit, zone, temp, reading.total_power_mw)

    # -- power modes ----------------------------------------------------------------------------

    def _maybe_switch_mode(self, now: float, temp: float, error: float) -> None:
        assert self.profile is not None and self.switcher is not None
        if self._last_switch_s is None:
            self._last_switch_s = now  # first decision one interval after the start
            return
        if now - self._last_switch_s < self.cfg.mode_switch_every_s:
            return
        current = self.switcher.current()
        active = self.power.active_mw
        if current is None or active is None or (abs(error) > 2.0 and self.duty < 1.0):
            return  # not settled yet: the predictions below assume a steady state
        self._last_switch_s = now
        idle = self._idle_mw()
        if self.duty < 1.0:
            allowed = idle + self.duty * (active - idle)  # what holds the target now
        else:
            # Steady-state headroom: R * extra power = the degrees left below the target.
            headroom_c = self.cfg.target_c - temp
            allowed = active + headroom_c * 1000.0 / self.cfg.thermal_resistance_c_per_w
        if self.cfg.power_cap_mw is not None:
            allowed = min(allowed, self.cfg.power_cap_mw)
        # Correct the profile's power estimates by what this board measures in this mode.
        bias = active / (self.profile.load_power_w(current) * 1000.0)

        def predicted(name: str) -> tuple[float, float]:
            mode_mw = self.profile.load_power_w(name) * 1000.0 * bias
            duty = 1.0 if mode_mw <= allowed else max(0.0, (allowed - idle) / (mode_mw - idle))
            return self.profile.relative_speed(name) * min(1.0, duty), min(1.0, duty)

        candidates = [
            m for m in self.switcher.available()
            if m != current and not self.profile.mode(m).needs_reboot
        ]
        if not candidates:
            return
        now_rate, _ = predicted(current)
        best = max(candidates, key=lambda m: predicted(m)[0])
        best_rate, best_duty = predicted(best)
        if now_rate > 0 and best_rate < now_rate * (1.0 + self.cfg.mode_switch_min_gain):
            return
        try:
            self.switcher.switch(best)
        except Exception as e:  # a refused switch (no root, nvpmodel error) must not stop training
            self._event(now, "power_mode", current, current, f"switch to {best} failed: {e}")
            return
        gain = (best_rate / now_rate - 1.0) * 100 if now_rate > 0 else math.inf
        self._event(now, "power_mode", current, best,
                    f"{allowed / 1000:.1f} W sustainable: predicted {gain:+.0f}% steps/s")
        # Bumpless transfer: start the new mode at the duty predicted to hold the same power.
        self.pi.track(max(self.cfg.min_duty, best_duty), error)
        self.power.active_mw = self.profile.load_power_w(best) * 1000.0 * bias


# ---------------------------------------------------------------------------------------------
# The thermostat baseline


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

    def update(self, reading: Reading, now_s: float, phase: Phase = "active") -> Decision:
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


# ---------------------------------------------------------------------------------------------
# The trainer hook


@dataclass
class PacingRecord:
    """What the hook saw, for the job report."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    compute_s: float = 0.0
    paced_s: float = 0.0
    waited_s: float = 0.0


class GovernorHook:
    """``TrainerHook`` that reads the sensors after every optimizer step, asks the controller
    for a duty and sleeps the matching pause through the injected clock.

    PAUSED: with ``on_pause="wait"`` the hook checkpoints (``trainer.save()``) and then sleeps,
    polling the sensors every ``poll_s``, until the controller lets training resume (giving up
    with ``trainer.request_stop`` after ``max_wait_s``); with ``on_pause="stop"`` it asks the
    trainer to checkpoint and return at once, for a supervisor to restart later."""

    def __init__(
        self,
        controller: DutyController,
        sensors: SensorBackend,
        *,
        clock: Clock | None = None,
        on_pause: Literal["wait", "stop"] = "wait",
        poll_s: float = 1.0,
        max_wait_s: float = 3600.0,
        idle_read_min_s: float = 0.02,
        record_every_s: float = 1.0,
        power_mode: PowerModeSwitcher | None = None,
    ) -> None:
        self.controller = controller
        self.sensors = sensors
        self.clock: Clock = clock or MonotonicClock()
        self.on_pause = on_pause
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s
        self.idle_read_min_s = idle_read_min_s
        self.record_every_s = record_every_s
        self.power_mode = power_mode
        self.record = PacingRecord()
        self.last: Decision | None = None
        self.start_s = self.clock.now()
        # Unknown until the first step ends: the first step also carries loader start-up.
        self._resumed_at: float | None = None
        self._last_sample_s = -math.inf
        self._last_metrics_s = -math.inf
        self._idle_mw: float | None = None
        self._window_mj = 0.0
        self._window_s = 0.0

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        now = self.clock.now()
        step_s = 0.0 if self._resumed_at is None else max(0.0, now - self._resumed_at)
        self.record.steps += 1
        self.record.compute_s += step_s
        reading = self.sensors.read()
        decision = self.last = self.controller.update(reading, now, "active")
        self._account(reading.total_power_mw, step_s)
        self._record_metrics(now, step, metrics)
        if decision.state == GovernorState.PAUSED and self.on_pause == "stop":
            trainer.request_stop(f"governor paused: {self._last_reason()}")
        elif decision.duty <= 0.0:
            if decision.state == GovernorState.PAUSED and hasattr(trainer, "save"):
                trainer.save()  # the next thing past the soft limit is the board's own throttle
            self._sample(self.clock.now(), step, decision)
            self._wait(trainer, step)
        elif decision.duty < 1.0 and step_s > 0:
            pause = step_s * (1.0 - decision.duty) / decision.duty
            self.clock.sleep(pause)
            self.record.paced_s += pause
            idle_mw = None
            if pause >= self.idle_read_min_s:
                idle = self.sensors.read()
                self.controller.update(idle, self.clock.now(), "idle")
                idle_mw = idle.total_power_mw
            self._account(idle_mw if idle_mw is not None else self._idle_mw, pause, idle=True)
        self._sample(self.clock.now(), step, decision)
        self._resumed_at = self.clock.now()

    def _wait(self, trainer: Any, step: int) -> None:
        waited = 0.0
        while True:
            self.clock.sleep(self.poll_s)
            waited += self.poll_s
            now = self.clock.now()
            reading = self.sensors.read()
            decision = self.last = self.controller.update(reading, now, "idle")
            self._account(reading.total_power_mw, self.poll_s, idle=True)
            self._sample(now, step, decision)
            if decision.duty > 0.0 and decision.state != GovernorState.PAUSED:
                break
            if waited >= self.max_wait_s:
                trainer.request_stop(f"governor waited {waited:.0f} s without cooling down")
                break
        self.record.waited_s += waited

    def _account(self, power_mw: float | None, seconds: float, idle: bool = False) -> None:
        """Energy of the sample window: a reading after a step stands for that step, one
        after a pause for the pause (the last idle reading when the pause was too short)."""
        if idle and power_mw is not None:
            self._idle_mw = power_mw
        if power_mw is not None and seconds > 0:
            self._window_mj += power_mw * seconds
            self._window_s += seconds

    def _last_reason(self) -> str:
        events = self.controller.events
        return events[-1].reason if events else "soft limit"

    def _sample(self, now: float, step: int, d: Decision) -> None:
        if now - self._last_sample_s < self.record_every_s:
            return
        self._last_sample_s = now
        avg_mw = self._window_mj / self._window_s if self._window_s > 0 else d.power_mw
        self._window_mj = self._window_s = 0.0
        self.record.samples.append({
            "t_s": now - self.start_s,
            "step": step,
            "temp_c": d.temp_c,
            "zone": d.zone,
            "power_mw": avg_mw,
            "power_now_mw": d.power_mw,
            "duty": d.duty,
            "state": d.state.value,
            "limit": d.limit,
            "power_mode": self.power_mode.current() if self.power_mode else None,
        })

    def _record_metrics(self, now: float, step: int, metrics: dict[str, float]) -> None:
        evaluated = any(k.startswith("eval/") for k in metrics)
        if evaluated or now - self._last_metrics_s >= self.record_every_s:
            self._last_metrics_s = now
            self.record.metrics.append({"t_s": now - self.start_s, "step": step, **metrics})
