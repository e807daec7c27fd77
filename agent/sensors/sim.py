"""Readings from the simulated plant (``agent.sim.plant``).

Three ways to drive it:
- simulated time (tests, benchmarks): the job advances the plant itself (steps and the
  ``SimClock``'s sleeps); ``read()`` only looks at it;
- one board per state dir (``sensors: sim`` in agent.yaml, ``agentctl finetune --sensors
  sim``): the daemon's telemetry, the fine-tune's governor and ``agentctl sensors --state-dir``
  read one :class:`SimBoard`, whose state lives in ``STATE_DIR/sim/plant.json``. Whichever
  process reads it advances it by the wall time since it was last written, times the board's
  time scale, with the load its processes put on the CPU meanwhile, so the board heats while a
  fine-tune trains and cools while it pauses, and every reader sees the same temperature
  (delete the file to start a new board: one that reached its critical temperature stays
  shut down, as a real one does until someone power-cycles it);
- no state dir (``agentctl sensors --backend sim`` alone): a board of this process's own,
  loaded by this process's CPU use.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.sensors.reading import Reading, total_power_mw
from agent.sim.plant import BoardShutdown, SimPlant
from device_profiles import load_profile
from device_profiles.schema import DeviceProfile
from registry.atomic import write_json_atomic

log = logging.getLogger("agent.sensors")

Driver = Callable[[], tuple[float, float]]
"""Returns (seconds to advance the plant, load 0..1 over them)."""

BOARD_FILE = Path("sim") / "plant.json"
"""The simulated board of a state dir, relative to it."""
PERSIST_S = 1.0
"""The board is written back (locked and fsynced: ~25 ms on a PC's SSD) at most this often. The
governor reads after every step, milliseconds apart for a small model: a read in between
advances a copy of the last written state in memory, by the same rule from the same inputs
(the file, the clock, the board's CPU counters), so every process still reads the same board."""
MAX_GAP_TAU = 20.0
"""A gap since the last advance (the board unread for days, the clock stepped forward) is
simulated for at most this many thermal time constants: the board has settled by then, and
the plant advances in 1 s thermal-poll steps."""
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(start time, user + system CPU) of a live process, in clock ticks; None once gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]), int(fields[11]) + int(fields[12])


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BoardProcess(_Strict):
    start_ticks: int
    """The process's start time: a pid the kernel reuses for another process is not it."""
    cpu_ticks: int
    """Its user + system CPU at the board's last advance."""


class BoardState(_Strict):
    """``STATE_DIR/sim/plant.json``: the plant's state and what advances it."""

    format: Literal["edgetrain.sim_board/1"] = "edgetrain.sim_board/1"
    profile: str
    """The device profile whose plant this is."""
    time_scale: float = Field(gt=0)
    """Simulated seconds per wall second."""
    wall_s: float
    """Unix time of the last write: the state above is the board's at that instant."""
    processes: dict[int, BoardProcess] = Field(default_factory=dict)
    """The processes that read this board, by pid: their CPU use is the board's load."""
    mode: str | None
    """The power mode (None: a profile without power modes, e.g. generic-x86)."""
    ambient_c: float
    temp_c: float
    time_s: float
    """Simulated seconds since the board was made: the readings' timestamp."""
    throttled: bool = False
    shutdown: bool = False
    power_w: float
    last_load: float = 0.0
    energy_j: float = 0.0
    throttled_s: float = 0.0
    max_temp_c: float


_PLANT_STATE = ("time_s", "throttled", "shutdown", "power_w", "last_load", "energy_j",
                "throttled_s", "max_temp_c")
"""What a ``SimPlant`` holds besides its parameters and temperature, kept in ``BoardState``
under the same names."""


class SimBoard:
    """The one simulated board of a state dir, shared by every process that reads it.

    Its load is the CPU the board's processes (every one that opened it: the daemon, the
    fine-tune child) used since the last advance, over the wall time, capped at 1: the
    daemon advancing the board sees the heat of the job's training. Not the host's total CPU
    (``/proc/stat``): several simulated devices on one host (``make demo``), or tests run side
    by side, would heat each other's boards. A process's CPU counts from when it opened the
    board until the last write before it exits (``SimBackend.close`` writes one): a reader
    killed outright takes at most ``PERSIST_S`` of its heat with it. Linux only (``/proc``).

    ``profile`` and ``time_scale``, when given, are the board's from then on (the fine-tune
    declares the board it paces); a reader that gives neither (the daemon) takes the board as
    it is. A new board starts at the ``sim`` profile's idle steady state, at time scale 1.
    """

    def __init__(self, state_dir: Path, *, profile: DeviceProfile | None = None,
                 time_scale: float | None = None) -> None:
        self.path = Path(state_dir) / BOARD_FILE
        self._profiles: dict[str, DeviceProfile] = {}
        if profile is not None:
            self._profiles[profile.name] = profile
        self._declared = (profile, time_scale)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._locked():
            state = self._load()
            if state is None:
                state = self._new()
            else:
                self._advance(state)
            if profile is not None and profile.name != state.profile:
                log.info("simulated board %s: profile %s -> %s", self.path, state.profile,
                         profile.name)
                state.profile, state.mode = profile.name, profile.plant.default_mode
                state.ambient_c = profile.plant.ambient_c
            if time_scale is not None:
                state.time_scale = time_scale
            self._join(state)
            self._save(state)

    def sync(self, *, persist: bool = False) -> SimPlant:
        """The board now: advanced by the wall time since it was last written (by any
        process), and written back when that was ``PERSIST_S`` or more ago, or ``persist``."""
        state = None if persist else self._load()
        if state is not None and 0.0 <= time.time() - state.wall_s < PERSIST_S:
            return self._advance(state)  # this read's view only: the copy is not written
        with self._locked():
            state = self._load()
            if state is None:  # removed meanwhile: a new board (how to reset one)
                state = self._new()
            try:
                plant = self._advance(state)
                self._join(state)
            finally:  # a board that shut down stays down for every reader
                self._save(state)
        return plant

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load(self) -> BoardState | None:
        try:
            return BoardState.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return None

    def _save(self, state: BoardState) -> None:
        write_json_atomic(self.path, state.model_dump(mode="json"))

    def _profile(self, name: str) -> DeviceProfile:
        if name not in self._profiles:
            self._profiles[name] = load_profile(name)
        return self._profiles[name]

    def _new(self) -> BoardState:
        profile, time_scale = self._declared
        plant = SimPlant(profile or self._profile("sim"))
        return BoardState(profile=plant.profile.name, time_scale=time_scale or 1.0,
                          wall_s=time.time(),
                          mode=plant.mode, ambient_c=plant.params.ambient_c, temp_c=plant.temp_c,
                          time_s=0.0, power_w=plant.power_w, max_temp_c=plant.temp_c)

    def _join(self, state: BoardState) -> None:
        pid = os.getpid()
        if pid not in state.processes and (now := _cpu_ticks(pid)) is not None:
            state.processes[pid] = BoardProcess(start_ticks=now[0], cpu_ticks=now[1])

    def _plant(self, state: BoardState) -> SimPlant:
        plant = SimPlant(self._profile(state.profile), ambient_c=state.ambient_c,
                         mode=state.mode, initial_c=state.temp_c)
        for name in _PLANT_STATE:
            setattr(plant, name, getattr(state, name))
        return plant

    def _busy_s(self, state: BoardState) -> float:
        """CPU seconds the board's processes used since the last advance; the gone ones leave."""
        busy = 0
        for pid, seen in list(state.processes.items()):
            now = _cpu_ticks(pid)
            if now is None or now[0] != seen.start_ticks:
                del state.processes[pid]
                continue
            busy += max(0, now[1] - seen.cpu_ticks)
            seen.cpu_ticks = now[1]
        return busy / _TICKS_PER_S

    def _advance(self, state: BoardState) -> SimPlant:
        plant = self._plant(state)
        now = time.time()
        dt_wall, state.wall_s = now - state.wall_s, now
        busy_s = self._busy_s(state)
        if dt_wall <= 0:  # the clock stepped back: start again from here
            return plant
        # Several busy threads or processes count as full load, not more.
        load = min(1.0, busy_s / dt_wall)
        try:
            plant.advance(min(dt_wall * state.time_scale, MAX_GAP_TAU * plant.params.tau_s), load)
        finally:
            state.temp_c = plant.temp_c
            for name in _PLANT_STATE:
                setattr(state, name, getattr(plant, name))
        return plant


class SimBackend:
    name = "sim"

    def __init__(
        self,
        plant: SimPlant,
        *,
        noise_c: float = 0.0,
        seed: int = 0,
        driver: Driver | None = None,
        board: SimBoard | None = None,
    ) -> None:
        self.plant = plant
        self.noise_c = noise_c
        self._rng = random.Random(seed)
        self._driver = driver
        self._board = board

    def read(self) -> Reading:
        if self._board is not None:
            self.plant = self._board.sync()
        elif self._driver is not None:
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
        if self._board is not None:
            # This process's CPU since the board was last written is its heat: a process that
            # is gone by the next write is no longer counted.
            with contextlib.suppress(BoardShutdown):
                self._board.sync(persist=True)


def open_sim(profile: DeviceProfile | None, time_scale: float | None,
             state_dir: Path | None) -> SimBackend:
    """The state dir's board, or without one a board of this process's own."""
    if state_dir is None:
        plant = SimPlant(profile if profile is not None else load_profile("sim"))
        return SimBackend(plant, driver=ProcessLoadDriver(time_scale or 1.0))
    board = SimBoard(state_dir, profile=profile, time_scale=time_scale)
    return SimBackend(board.sync(), board=board)
