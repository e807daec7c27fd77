"""What a board is, as one validated model: memory, power modes, thermal limits, precision,
TensorRT features and the thermal/power plant estimate used by the simulator and to tune the
governor.

YAML is the on-disk form (one file per board next to this module); unknown keys are errors and
every error names its field path and a fix.
"""

from __future__ import annotations

import itertools
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DetectRule(StrictModel):
    model_patterns: list[str] = Field(default_factory=list)
    """Regular expressions (case-insensitive) matched against ``/proc/device-tree/model``."""
    compatible: list[str] = Field(default_factory=list)
    """Module part numbers (e.g. ``p3767-0003``) looked for in ``/proc/device-tree/compatible``;
    they name the exact module even on third-party carrier boards."""
    mem_total_mb: tuple[int, int] | None = None
    """[min, max] of MemTotal in MB: tells apart variants that share a model string."""

    @model_validator(mode="after")
    def _check(self) -> DetectRule:
        for pattern in self.model_patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"model_patterns: {pattern!r} is not a valid regex ({e})") from e
        if self.mem_total_mb and self.mem_total_mb[0] > self.mem_total_mb[1]:
            raise ValueError("mem_total_mb: write [min, max] with min <= max")
        return self


class MemoryProfile(StrictModel):
    total_mb: int = Field(gt=0)
    """Installed DRAM (nominal, e.g. 8192 for an 8 GB module; the OS sees a little less)."""
    training_budget_mb: int = Field(gt=0)
    """Default memory a fine-tune may use (process RSS plus GPU allocations), leaving room for
    the OS, the agent and the inference service. A job's own budget overrides it."""
    unified: bool = True
    """CPU and GPU share DRAM (every Jetson): GPU memory comes out of the same budget."""

    @model_validator(mode="after")
    def _check(self) -> MemoryProfile:
        if self.training_budget_mb >= self.total_mb:
            raise ValueError(
                f"training_budget_mb ({self.training_budget_mb}) must be below total_mb "
                f"({self.total_mb}): leave room for the OS"
            )
        return self


class PowerMode(StrictModel):
    name: str
    """The mode's name exactly as ``nvpmodel`` spells it (``15W``, ``MAXN_SUPER``). Its numeric
    id is read on the board at run time: ids differ by board and JetPack release."""
    watts: float | None = Field(default=None, gt=0)
    """Power budget of the mode; null for MAXN modes, which are not capped."""
    min_jetpack: str | None = None
    """First JetPack release that offers the mode (e.g. ``6.2`` for the Super modes)."""
    needs_reboot: bool = False
    """Switching into this mode takes effect only after a reboot (different GPU power-gating)."""
    train_power_w: float | None = Field(default=None, gt=0)
    """Estimated board input power at full training load in this mode (plant estimate)."""
    relative_speed: float | None = Field(default=None, gt=0, le=1)
    """Estimated training steps/s relative to the board's fastest mode (plant estimate)."""


class ThermalProfile(StrictModel):
    throttle_target_c: float
    """The governor keeps the hottest zone at or below this temperature."""
    soft_pause_c: float
    """Above this the governor pauses training (the caller checkpoints) until it cools."""
    resume_below_c: float
    """A paused job resumes once the hottest zone is below this (hysteresis band)."""
    board_throttle_c: float
    """The board's own software throttling point (clocks drop; 99 C on Orin)."""
    critical_c: float
    """The board shuts down here (104.5 C on Orin)."""
    control_zones: list[str] | None = None
    """Zone names (normalised: ``tj``, ``cpu``, ``gpu``...) the governor regulates; null = the
    hottest of all zones that are real die sensors."""
    sources: list[str] = Field(default_factory=list)
    """Where the limits come from (device tree, data sheet) or why they are estimates."""

    @model_validator(mode="after")
    def _check(self) -> ThermalProfile:
        order = [
            ("throttle_target_c", self.throttle_target_c),
            ("soft_pause_c", self.soft_pause_c),
            ("board_throttle_c", self.board_throttle_c),
            ("critical_c", self.critical_c),
        ]
        for (a, va), (b, vb) in itertools.pairwise(order):
            if va >= vb:
                raise ValueError(f"{a} ({va}) must be below {b} ({vb})")
        if not self.throttle_target_c <= self.resume_below_c < self.soft_pause_c:
            raise ValueError(
                f"resume_below_c ({self.resume_below_c}) must lie in [throttle_target_c, "
                f"soft_pause_c) = [{self.throttle_target_c}, {self.soft_pause_c})"
            )
        return self


class PrecisionProfile(StrictModel):
    fp16: bool
    """Half precision training (autocast + loss scaling) is supported and fast."""
    bf16: bool
    """bfloat16 is supported in hardware (Ampere and newer; Orin yes, Xavier and Nano no)."""
    int8: bool
    """INT8 inference is fast: TensorRT on Jetson (not on Maxwell: Jetson Nano), ONNX Runtime
    with VNNI elsewhere."""


class TensorRTProfile(StrictModel):
    gpu_arch: Literal["maxwell", "volta", "ampere", "none"]
    compute_capability: str | None = None
    """CUDA compute capability, e.g. ``8.7`` for Orin."""
    sparsity_2_4: bool
    """Structured 2:4 sparsity speeds up inference (Ampere tensor cores and newer)."""
    dla_cores: int = Field(ge=0)
    """NVDLA engines TensorRT can target (0 when the module has none)."""


class PlantProfile(StrictModel):
    """First-order thermal RC and power model of the board in its enclosure.

    dT/dt = (ambient + R * P - T) / (R * C); P = idle + duty * (load - idle), with load the
    power mode's ``train_power_w``. The simulator runs it; the governor derives its default
    controller gains from it. Each value is an estimate: ``sources`` says where it comes from.
    """

    scenario: str
    """The installation the numbers describe (heat sink, airflow, enclosure)."""
    ambient_c: float
    """Air temperature around the heat sink (inside the enclosure)."""
    thermal_resistance_c_per_w: float = Field(gt=0)
    """Junction to ambient air, through module, thermal pad and heat sink (C per W)."""
    heat_capacity_j_per_c: float = Field(gt=0)
    """Lumped heat capacity of module plus heat sink (J per C)."""
    idle_power_w: float = Field(gt=0)
    """Board input power while training is paused."""
    step_time_s: float = Field(gt=0)
    """One training step of the reference job at full clocks in the fastest mode."""
    default_mode: str | None = None
    """The power mode the simulated board starts in (null: boards without power modes)."""
    load_power_w: float | None = Field(default=None, gt=0)
    """Board power at full training load for boards without power modes."""
    throttle_clock_factor: float = Field(gt=0, lt=1)
    """Clock ratio the board's own throttle leaves (steps slow by its inverse; dynamic power
    scales with its square since voltage drops with frequency)."""
    throttle_hysteresis_c: float = Field(ge=0)
    """The board's throttle releases this far below ``board_throttle_c``."""
    zone_offsets_c: dict[str, float] = Field(default_factory=lambda: {"tj": 0.0})
    """Per-zone temperature relative to the modelled junction (0 for the hottest)."""
    sources: list[str] = Field(min_length=1)
    """Where each number comes from, or the reasoning behind an estimate."""


class DeviceProfile(StrictModel):
    name: str
    """File name without .yaml, e.g. ``jetson-orin-nano-8gb``."""
    description: str
    family: Literal["orin", "xavier", "nano", "x86", "sim"]
    detect: DetectRule = Field(default_factory=DetectRule)
    memory: MemoryProfile
    power_modes: list[PowerMode] = Field(default_factory=list)
    default_power_mode: str | None = None
    """The mode a freshly flashed board boots in (confirm with ``nvpmodel -q``)."""
    thermal: ThermalProfile
    precision: PrecisionProfile
    tensorrt: TensorRTProfile
    sensors: list[Literal["jtop", "tegrastats", "sysfs", "sim"]] = Field(min_length=1)
    """Sensor backends to try, in order, for ``--sensors auto``."""
    plant: PlantProfile

    @model_validator(mode="after")
    def _check(self) -> DeviceProfile:
        names = [m.name for m in self.power_modes]
        if len(set(names)) != len(names):
            raise ValueError(f"power_modes: duplicate names in {names}")
        for field, value in (
            ("default_power_mode", self.default_power_mode),
            ("plant.default_mode", self.plant.default_mode),
        ):
            if value is not None and value not in names:
                raise ValueError(f"{field}: {value!r} is not one of power_modes {names}")
        if self.power_modes:
            if self.plant.default_mode is None:
                raise ValueError("plant.default_mode: name the power mode the plant starts in")
            missing = [m.name for m in self.power_modes if m.train_power_w is None]
            if missing:
                raise ValueError(f"power_modes: train_power_w missing for {missing}")
            for m in self.power_modes:
                if m.relative_speed is None:
                    raise ValueError(f"power_modes: relative_speed missing for {m.name!r}")
        elif self.plant.load_power_w is None:
            raise ValueError("plant.load_power_w is required for a board without power_modes")
        return self

    def mode(self, name: str) -> PowerMode:
        for m in self.power_modes:
            if m.name == name:
                return m
        have = [m.name for m in self.power_modes]
        raise KeyError(f"{self.name}: no power mode {name!r} (have {have})")

    def load_power_w(self, mode: str | None = None) -> float:
        """Estimated power at full training load in ``mode`` (default: the plant's mode)."""
        name = mode or self.plant.default_mode
        if name is None:
            assert self.plant.load_power_w is not None  # guaranteed by _check
            return self.plant.load_power_w
        power = self.mode(name).train_power_w
        assert power is not None
        return power

    def relative_speed(self, mode: str | None = None) -> float:
        name = mode or self.plant.default_mode
        if name is None:
            return 1.0
        speed = self.mode(name).relative_speed
        assert speed is not None
        return speed
