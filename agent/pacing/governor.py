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
- Latency loop (``agent.pacing.latency_loop``): training yields to the application. A second
  PI loop holds the application's inference p99 under its SLO; the duty applied is the least
  of the thermal, power and latency duties, and the loops not in charge track it (bumpless).
  Yielding completely (duty 0) leaves the state THROTTLED: no checkpoint, unlike the pause.
- Optional power-mode switching: when throttled, a lower-clocked mode can deliver more steps
  per second inside the same power envelope (voltage falls with frequency); switches are rare
  (``mode_switch_every_s``) and need a predicted gain of ``mode_switch_min_gain``.

``agent.pacing.hook.GovernorHook`` plugs it into ``hpc_core.Trainer`` as a ``TrainerHook``;
the choice of power mode is ``agent.pacing.power_modes``; the thermostat baseline the
benchmark compares against is ``agent.sim.baselines.BangBangGovernor``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.pacing.controller import (
    AppLatency,
    Decision,
    GovernorEvent,
    GovernorState,
    Phase,
    PIController,
)
from agent.pacing.latency_loop import LatencyLoop
from agent.pacing.power_modes import PowerModeSwitcher, choose_mode
from agent.sensors.reading import Reading
from device_profiles.schema import DeviceProfile

log = logging.getLogger(__name__)


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
    latency_slo_ms: float | None = Field(default=None, gt=0)
    """The application's inference p99 objective (None: the one its runtime states, if any)."""
    latency_margin: float = Field(default=0.1, ge=0, lt=1)
    """The latency loop aims this share below the SLO."""
    latency_kp: float = Field(default=0.8, gt=0)
    """Duty per unit of relative latency error ((setpoint - p99) / slo)."""
    latency_ti_s: float = Field(default=5.0, gt=0)
    latency_yield_after_s: float = Field(default=5.0, ge=0)
    """At min_duty and still over the SLO this long: yield completely (duty 0)."""

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
        self.latency = LatencyLoop(
            slo_ms=cfg.latency_slo_ms, margin=cfg.latency_margin, kp=cfg.latency_kp,
            ti_s=cfg.latency_ti_s, min_duty=cfg.min_duty, yield_after_s=cfg.latency_yield_after_s)

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

    def update(self, reading: Reading, now_s: float, phase: Phase = "active",
               latency: AppLatency | None = None) -> Decision:
        if reading.total_power_mw is not None:
            self.power.add(phase, reading.total_power_mw)
        started = self.latency.update(latency, now_s)
        if started:
            self._event(now_s, "state", self.state.value, GovernorState.THROTTLED.value, started)
            self.state = GovernorState.THROTTLED
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
            if self.latency.yielding or self.limit == "latency":
                self._apply_latency()
            return self._decision(self.duty, zone, temp, reading)

        dt = 0.0 if self._last_active_s is None else now_s - self._last_active_s
        self._last_active_s = now_s
        error = self.cfg.target_c - self.cfg.setpoint_margin_c - temp
        thermal = self.pi.update(error, dt)
        power = self._power_duty()
        latency_duty = self.latency.duty
        duty = min(thermal, power, latency_duty)
        if duty < thermal:
            self.pi.track(max(duty, self.cfg.min_duty), error)
        self.latency.track(duty)
        self.limit = None if duty >= 1.0 else min(
            (("thermal", thermal), ("power", power), ("latency", latency_duty)),
            key=lambda kv: kv[1])[0]
        self.duty = duty
        self._update_state(now_s, zone, temp)
        if self.cfg.allow_mode_switch:
            self._maybe_switch_mode(now_s, temp, error)
        return self._decision(self.duty, zone, temp, reading)

    def _update_state(self, now: float, zone: str | None, temp: float | None) -> None:
        if self.duty < 1.0:
            self._full_since = None
        elif self._full_since is None:
            self._full_since = now
        if self.state == GovernorState.NORMAL and self.duty < self.cfg.throttled_below_duty:
            if self.limit == "power":
                watts = (self.power.active_mw or 0.0) / 1000
                cap = (self.cfg.power_cap_mw or 0.0) / 1000
                why = f"power {watts:.1f} W over cap {cap:.1f} W"
            elif self.limit == "latency":
                why = self.latency.why()
            elif temp is not None:
                why = f"{zone} {temp:.1f} C approaching target {self.cfg.target_c:.1f} C"
            else:
                why = "no temperature"
            self._set_state(now, GovernorState.THROTTLED, f"{why}: duty {self.duty:.2f}")
        elif (
            self.state == GovernorState.THROTTLED
            and self._full_since is not None
            and now - self._full_since >= self.cfg.normal_after_s
        ):
            where = f"{zone} {temp:.1f} C: " if zone is not None and temp is not None else ""
            self._set_state(now, GovernorState.NORMAL, f"{where}headroom, full speed")

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
            power = self._power_duty() if self.cfg.power_cap_mw is not None else 1.0
            latency_duty = self.latency.duty
            self.duty = min(power, latency_duty)
            self.limit = None if self.duty >= 1.0 else (
                "latency" if latency_duty <= power else "power")
            self._update_state(now, None, None)
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

    def note_unavailable(self, kind: str, reason: str) -> None:
        """Say once, at the start, that something the job asked for cannot be done here."""
        self._event(0.0, kind, "unavailable", "unavailable", reason)

    # -- the application's latency --------------------------------------------------------------

    @property
    def last_p99_ms(self) -> float | None:
        return self.latency.last_p99_ms

    def _apply_latency(self) -> None:
        """While training waits on the application (phase idle), let the latency loop alone
        move the duty: the thermal loop steps only after a training step."""
        if self.latency.yielding:
            self.duty, self.limit = 0.0, "latency"
            return
        before = self.duty if self.duty > 0 else 1.0
        self.duty = min(before, self.latency.duty)
        if self.latency.duty < before:
            self.limit = "latency"  # else the next step's update names whichever limit holds

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
        choice = choose_mode(
            self.profile,
            current,
            self.switcher.available(),
            active_mw=active,
            idle_mw=idle,
            allowed_mw=allowed,
            min_gain=self.cfg.mode_switch_min_gain,
        )
        if choice is None:
            return
        best = choice.mode
        try:
            self.switcher.switch(best)
        except Exception as e:  # a refused switch (no root, nvpmodel error) must not stop training
            self._event(now, "power_mode", current, current, f"switch to {best} failed: {e}")
            return
        self._event(
            now, "power_mode", current, best,
            f"{allowed / 1000:.1f} W sustainable: predicted {choice.gain_pct:+.0f}% steps/s",
        )
        # Bumpless transfer: start the new mode at the duty predicted to hold the same power.
        self.pi.track(max(self.cfg.min_duty, choice.duty), error)
        self.power.active_mw = choice.active_mw
