"""Readings from the simulated plant (``agent.sim.plant``).

Two ways to drive it:
- simulated time (tests, benchmarks): the job advances the plant itself (steps and the
  ``SimClock``'s sleeps); ``read()`` only looks at it;
- wall time (``agentctl sensors --backend sim``, or a real fine-tune on a PC with
  ``--sensors sim``): each ``read()`` first advances the plant by the wall time since the last
  read, times ``time_scale``, with the load taken from this process's CPU use over that
  interval, so the simulated board heats while training runs and cools while it pauses.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from agent.sensors.reading import Reading, total_power_mw
from agent.sim.plant import SimPlant

Driver = Callable[[], tuple[float, float]]
"""Returns (seconds to advance the plant, load 0..1 over them)."""


class ProcessLoadDriver:
    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale
        self._wall = time.monotonic()
        self._cpu = time.process_time()

    def __call__(self) -> tuple[float, float]:
        wall, cpu = time.monotonic(), time.process_time()
        dt_wall, dt_cpu = wall - self._wall, cpu - self._cpu
        self._wall, self._cpu = wall, cpu
        if dt_wall <= 0:
            return 0.0, 0.0
        # Several busy threads count as full load, not more.
        return dt_wall * self.time_scale, min(1.0, dt_cpu / dt_wall)


class SimBackend:
    name = "sim"

    def __init__(
        self,
        plant: SimPlant,
        *,
        noise_c: float = 0.0,
        seed: int = 0,
        driver: Driver | None = None,
    ) -> None:
        self.plant = plant
        self.noise_c = noise_c
        self._rng = random.Random(seed)
        self._driver = driver

    def read(self) -> Reading:
        if self._driver is not None:
            dt, load = self._driver()
            if dt > 0:
                self.plant.advance(dt, load)
        temps = {
            zone: t + (self._rng.gauss(0.0, self.noise_c) if self.noise_c else 0.0)
            for zone, t in self.plant.zone_temps().items()
        }
        rails = {"VDD_IN": self.plant.power_w * 1000.0}
        total_mb = float(self.plant.profile.memory.total_mb)
        return Reading(
            timestamp_s=self.plant.time_s,
            temps_c=temps,
            rails_mw=rails,
            total_power_mw=total_power_mw(rails),
            ram_total_mb=total_mb,
            gpu_load_pct=100.0 * self.plant.last_load,
            power_mode=self.plant.mode,
            source=self.name,
        )

    def close(self) -> None:
        pass
