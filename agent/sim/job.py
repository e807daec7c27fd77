"""A paced training job on the simulated plant, in simulated time: the reference for the
governor's tests and benchmark. The job's "steps" are the plant's (``SimPlant.run_step``);
pacing goes through the same ``GovernorHook`` a real ``hpc_core.Trainer`` uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from agent.pacing.controller import DutyController, GovernorEvent
from agent.pacing.governor import Governor, GovernorConfig
from agent.pacing.hook import GovernorHook
from agent.sensors.sim import SimBackend
from agent.sim.baselines import BangBangGovernor
from agent.sim.plant import BoardShutdown, PlantParams, SimClock, SimPlant
from device_profiles.schema import DeviceProfile

Control = Literal["governor", "bangbang", "none"]


class SimModeSwitcher:
    """Power-mode switching on the simulated board (``nvpmodel -m`` on a real one)."""

    def __init__(self, plant: SimPlant, modes: list[str] | None = None) -> None:
        self.plant = plant
        self.modes = modes or [m.name for m in plant.profile.power_modes]

    def current(self) -> str | None:
        return self.plant.mode

    def available(self) -> list[str]:
        return list(self.modes)

    def switch(self, name: str) -> None:
        self.plant.set_mode(name)


class _SimTrainer:
    """The two trainer calls the hook makes, recorded instead of acted on."""

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.saves = 0

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def save(self) -> None:
        self.saves += 1


@dataclass
class SimJobResult:
    control: str
    duration_s: float
    steps: int
    max_temp_c: float
    time_above_target_s: float
    max_over_target_c: float
    board_throttled_s: float
    energy_j: float
    shutdown: bool
    stop_reason: str | None
    checkpoints: int
    params: PlantParams
    target_c: float
    initial_c: float
    ambients_c: list[float]
    """Every ambient the job saw (more than one with an ambient schedule)."""
    power_cap_w: float | None
    events: list[GovernorEvent] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Per second: t_s, steps, temp_c (true plant temperature), energy_j (cumulative), duty,
    state, mode, throttled (the board's own throttle)."""

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.duration_s

    def best_constant_duty(self) -> float:
        """The largest constant duty that stays under the target (and the cap) all job long:
        the hottest ambient of the job decides."""
        return min(
            replace(self.params, ambient_c=a).best_constant_duty(self.target_c, self.power_cap_w)
            for a in self.ambients_c
        )

    def optimum_steps_per_s(self) -> float:
        """Steps/s of the best constant duty that stays under the target (analytic, from the
        plant's steady state), in the mode the job started in."""
        return self.best_constant_duty() / self.params.step_time_s

    def relative_throughput(self) -> float:
        return self.steps_per_s / self.optimum_steps_per_s()

    def ideal_steps_per_s(self) -> float | None:
        """The time-optimal schedule for this plant, an upper bound for any controller: full
        speed until the target is reached, then the duty that holds it there. Only for a
        constant ambient and no power cap (None otherwise)."""
        if len(self.ambients_c) > 1 or self.power_cap_w is not None:
            return None
        p, step = self.params, self.params.step_time_s
        hot = p.steady_state_c(1.0)
        if hot <= self.target_c:
            return 1.0 / step
        t_reach = 0.0
        if self.initial_c < self.target_c:
            t_reach = p.tau_s * math.log((hot - self.initial_c) / (hot - self.target_c))
        t_reach = min(t_reach, self.duration_s)
        steps = t_reach / step + (self.duration_s - t_reach) * self.best_constant_duty() / step
        return steps / self.duration_s


def simulate_job(
    profile: DeviceProfile,
    *,
    control: Control = "governor",
    duration_s: float = 1800.0,
    ambient_c: float | None = None,
    mode: str | None = None,
    noise_c: float = 0.2,
    seed: int = 0,
    governor_cfg: GovernorConfig | None = None,
    allow_mode_switch: bool = False,
    bangbang_hysteresis_c: float = 2.0,
    ambient_schedule: Sequence[tuple[float, float]] = (),
    power_cap_mw: float | None = None,
    plant: SimPlant | None = None,
) -> SimJobResult:
    """Run ``duration_s`` of simulated training under ``control`` and measure it against the
    plant's true (noise-free) temperature. ``ambient_schedule``: (time s, ambient C) changes,
    e.g. the sun reaching the enclosure. ``power_cap_mw`` binds the governor only (the
    baselines ignore it) and enters the optimum all controls are compared with."""
    plant = plant or SimPlant(profile, ambient_c=ambient_c, mode=mode)
    start_params, initial_c = plant.params, plant.temp_c
    sensors = SimBackend(plant, noise_c=noise_c, seed=seed)
    clock = SimClock(plant)
    switcher = SimModeSwitcher(plant)
    target = profile.thermal.throttle_target_c
    controller: DutyController | None = None
    if control == "governor":
        cfg = governor_cfg or GovernorConfig.from_profile(
            profile, mode=plant.mode, allow_mode_switch=allow_mode_switch,
            power_cap_mw=power_cap_mw,
        )
        target = cfg.target_c
        controller = Governor(
            cfg, profile=profile, switcher=switcher if allow_mode_switch else None
        )
    elif control == "bangbang":
        controller = BangBangGovernor(target, bangbang_hysteresis_c,
                                      profile.thermal.control_zones)
    hook = (
        GovernorHook(controller, sensors, clock=clock, record_every_s=1e9, power_mode=switcher)
        if controller is not None else None
    )
    trainer = _SimTrainer()
    steps = 0
    above_s = 0.0
    max_over = -1e9
    samples: list[dict[str, Any]] = []
    next_sample = 0.0
    shutdown = False
    schedule = sorted(ambient_schedule)
    try:
        while plant.time_s < duration_s and trainer.stop_reason is None:
            while schedule and plant.time_s >= schedule[0][0]:
                plant.set_ambient(schedule.pop(0)[1])
            t0, temp0 = plant.time_s, plant.temp_c
            plant.run_step()
            steps += 1
            if hook is not None:
                hook.on_step_end(trainer, steps, {})
            # Temperature is monotone within each constant-power segment, so the interval's
            # share above target is bounded by its endpoints; count it when either is above.
            if max(temp0, plant.temp_c) > target:
                above_s += plant.time_s - t0
            max_over = max(max_over, plant.max_temp_c - target)
            if plant.time_s >= next_sample:
                samples.append({
                    "t_s": plant.time_s,
                    "steps": steps,
                    "temp_c": plant.temp_c,
                    "energy_j": plant.energy_j,
                    "duty": hook.last.duty if hook is not None and hook.last else 1.0,
                    "state": controller.state.value if controller else "NORMAL",
                    "mode": plant.mode,
                    "throttled": plant.throttled,
                })
                next_sample = plant.time_s + 1.0
    except BoardShutdown:
        shutdown = True
    return SimJobResult(
        control=control,
        duration_s=plant.time_s,
        steps=steps,
        max_temp_c=plant.max_temp_c,
        time_above_target_s=above_s,
        max_over_target_c=max_over,
        board_throttled_s=plant.throttled_s,
        energy_j=plant.energy_j,
        shutdown=shutdown,
        stop_reason=trainer.stop_reason,
        checkpoints=trainer.saves,
        params=start_params,
        target_c=target,
        initial_c=initial_c,
        ambients_c=[start_params.ambient_c, *(a for _, a in sorted(ambient_schedule))],
        power_cap_w=None if power_cap_mw is None else power_cap_mw / 1000.0,
        events=list(controller.events) if controller else [],
        samples=samples,
    )
