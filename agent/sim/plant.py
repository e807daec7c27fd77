"""A physical model of a board to develop and test pacing against, in simulated time.

First-order thermal RC: the module and heat sink are one lumped heat capacity C behind one
thermal resistance R to the ambient air,

    C dT/dt = P - (T - T_ambient) / R          (time constant tau = R * C)

solved exactly for piecewise-constant power. Power is ``idle + load * (train - idle)`` with
``load`` the share of time spent computing (the training duty cycle) and ``train`` the power
mode's full-load power. Above ``board_throttle_c`` the board throttles itself like a Jetson:
clocks drop to ``throttle_clock_factor`` (steps take 1/f as long, dynamic power falls with f^2)
until it cools ``throttle_hysteresis_c`` below; the thermal framework re-evaluates every
second, so the plant advances in steps of at most 1 s. At ``critical_c`` it shuts down.

Every parameter comes from the board's profile (``plant`` section, with sources).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from device_profiles.schema import DeviceProfile

THERMAL_POLL_S = 1.0
"""polling-delay-passive of the Tegra thermal zones: the board's throttle reacts this often."""


class BoardShutdown(RuntimeError):
    """The simulated board reached its critical temperature."""


@dataclass(frozen=True)
class PlantParams:
    ambient_c: float
    r_c_per_w: float
    c_j_per_c: float
    idle_w: float
    train_w: float
    step_time_s: float
    """One step at full clocks in the current power mode."""
    board_throttle_c: float
    release_c: float
    clock_factor: float
    critical_c: float

    @property
    def tau_s(self) -> float:
        return self.r_c_per_w * self.c_j_per_c

    def power_w(self, load: float, throttled: bool = False) -> float:
        f2 = self.clock_factor**2 if throttled else 1.0
        return self.idle_w + load * (self.train_w - self.idle_w) * f2

    def steady_state_c(self, duty: float) -> float:
        """Temperature the board settles at under a constant duty cycle (below the throttle)."""
        return self.ambient_c + self.r_c_per_w * self.power_w(duty)

    def best_constant_duty(self, target_c: float, power_cap_w: float | None = None) -> float:
        """Largest constant duty whose steady state stays at or below ``target_c`` (and whose
        average power stays under the cap). From a cooler start the temperature rises
        monotonically towards that steady state, so it never exceeds the target."""
        allowed_w = (target_c - self.ambient_c) / self.r_c_per_w
        if power_cap_w is not None:
            allowed_w = min(allowed_w, power_cap_w)
        duty = (allowed_w - self.idle_w) / (self.train_w - self.idle_w)
        return min(1.0, max(0.0, duty))


def plant_params(
    profile: DeviceProfile, *, mode: str | None = None, ambient_c: float | None = None
) -> PlantParams:
    p = profile.plant
    return PlantParams(
        ambient_c=p.ambient_c if ambient_c is None else ambient_c,
        r_c_per_w=p.thermal_resistance_c_per_w,
        c_j_per_c=p.heat_capacity_j_per_c,
        idle_w=p.idle_power_w,
        train_w=profile.load_power_w(mode),
        step_time_s=p.step_time_s / profile.relative_speed(mode),
        board_throttle_c=profile.thermal.board_throttle_c,
        release_c=profile.thermal.board_throttle_c - p.throttle_hysteresis_c,
        clock_factor=p.throttle_clock_factor,
        critical_c=profile.thermal.critical_c,
    )


class SimPlant:
    """The simulated board. Time only moves through ``advance`` / ``run_step`` (and the
    ``SimClock`` that sleeps by advancing it), so hours run in milliseconds."""

    def __init__(
        self,
        profile: DeviceProfile,
        *,
        ambient_c: float | None = None,
        mode: str | None = None,
        initial_c: float | None = None,
    ) -> None:
        self.profile = profile
        self.mode = mode or profile.plant.default_mode
        self.params = plant_params(profile, mode=self.mode, ambient_c=ambient_c)
        # A board that has been idling settles at its idle steady state.
        self.temp_c = self.params.steady_state_c(0.0) if initial_c is None else initial_c
        self.time_s = 0.0
        self.throttled = False
        self.shutdown = False
        self.power_w = self.params.idle_w
        self.last_load = 0.0
        self.energy_j = 0.0
        self.throttled_s = 0.0
        self.max_temp_c = self.temp_c

    def set_mode(self, mode: str) -> None:
        """Switch power mode: changes full-load power and step time."""
        self.params = plant_params(self.profile, mode=mode, ambient_c=self.params.ambient_c)
        self.mode = mode

    def set_ambient(self, ambient_c: float) -> None:
        self.params = plant_params(self.profile, mode=self.mode, ambient_c=ambient_c)

    def _update_throttle(self) -> None:
        if self.throttled:
            self.throttled = self.temp_c > self.params.release_c
        else:
            self.throttled = self.temp_c >= self.params.board_throttle_c

    def advance(self, dt_s: float, load: float) -> None:
        """Let ``dt_s`` seconds pass with the given compute share (0 idle .. 1 full load)."""
        if self.shutdown:
            raise BoardShutdown(f"board shut down at {self.params.critical_c} C")
        remaining = dt_s
        while remaining > 1e-12:
            # The throttle state changes only at the thermal framework's poll boundaries.
            next_poll = (math.floor(self.time_s / THERMAL_POLL_S + 1e-9) + 1) * THERMAL_POLL_S
            dt = min(remaining, next_poll - self.time_s)
            p = self.params.power_w(load, self.throttled)
            t_ss = self.params.ambient_c + self.params.r_c_per_w * p
            self.temp_c = t_ss + (self.temp_c - t_ss) * math.exp(-dt / self.params.tau_s)
            self.energy_j += p * dt
            if self.throttled:
                self.throttled_s += dt
            self.time_s += dt
            remaining -= dt
            self.power_w = p
            self.max_temp_c = max(self.max_temp_c, self.temp_c)
            if self.temp_c >= self.params.critical_c:  # thermtrip is immediate, not polled
                self.shutdown = True
                raise BoardShutdown(f"board reached {self.temp_c:.1f} C >= critical")
            if self.time_s >= next_poll - 1e-9:
                self._update_throttle()
        self.last_load = load

    def run_step(self) -> float:
        """One training step at full load; returns its duration (longer while throttled)."""
        factor = self.params.clock_factor if self.throttled else 1.0
        duration = self.params.step_time_s / factor
        self.advance(duration, 1.0)
        return duration

    def zone_temps(self) -> dict[str, float]:
        return {z: self.temp_c + off for z, off in self.profile.plant.zone_offsets_c.items()}


class SimClock:
    """The injected clock of a simulated job: ``sleep`` lets the board idle for that long."""

    def __init__(self, plant: SimPlant) -> None:
        self.plant = plant

    def now(self) -> float:
        return self.plant.time_s

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.plant.advance(seconds, 0.0)
