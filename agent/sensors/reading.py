"""One sensor reading, whatever the backend: temperatures per zone, power per rail, memory,
GPU load. Zone names are normalised so every backend speaks the same language: ``tj``,
``cpu``, ``gpu``, ``soc0``, ``cv0``, ``tboard``... (tegrastats' ``CPU@40C``, sysfs'
``CPU-therm`` and ``cpu-thermal``, and jtop's ``Temp CPU`` all become ``cpu``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Offline sensors read -256 C on Orin (a power-gated GPU or CV cluster).
OFFLINE_BELOW_C = -200.0
# Zones that are not die temperatures: the PMIC zone of Nano/TX2/Xavier reports a fixed 50 or
# 100 C placeholder, which would otherwise always look like the hottest zone.
NOT_DIE_ZONES = frozenset({"pmic"})
# Rails that already carry the board's total input; the others are subsets of it.
TOTAL_RAILS = ("VDD_IN", "POM_5V_IN", "VIN")
# INA3221 channels wired to nothing.
UNCONNECTED_RAILS = frozenset({"NC"})


def zone_key(name: str) -> str:
    """Normalise a thermal zone name across tegrastats, sysfs and jtop."""
    key = name.strip().lower().replace(" ", "_")
    if key.startswith("temp_"):
        key = key[len("temp_") :]
    if key == "thermal-fan-est":
        return "thermal"
    for suffix in ("-thermal", "-therm", "_tegra", "-die"):
        key = key.removesuffix(suffix)
    return key


def total_power_mw(rails: Mapping[str, float]) -> float | None:
    """Board input power: the input rail where there is one (never add it to the rails it
    feeds), else the sum of all rails (AGX Orin and AGX Xavier have no input rail)."""
    for name in TOTAL_RAILS:
        if name in rails:
            return rails[name]
    connected = [v for k, v in rails.items() if k not in UNCONNECTED_RAILS]
    return float(sum(connected)) if connected else None


@dataclass(frozen=True)
class Reading:
    timestamp_s: float
    """Seconds on the backend's clock (wall clock for hardware, simulated time for sim)."""
    temps_c: Mapping[str, float] = field(default_factory=dict)
    """Online zones only, by normalised name."""
    rails_mw: Mapping[str, float] = field(default_factory=dict)
    """Instantaneous power per rail, by the rail's own name (``VDD_IN``, ``VDD_CPU_GPU_CV``)."""
    total_power_mw: float | None = None
    ram_used_mb: float | None = None
    ram_total_mb: float | None = None
    swap_used_mb: float | None = None
    swap_total_mb: float | None = None
    nvmap_used_mb: float | None = None
    """System-wide GPU allocations (NvMapMemUsed in /proc/meminfo) on Jetson."""
    gpu_load_pct: float | None = None
    gpu_freq_mhz: float | None = None
    cpu_load_pct: tuple[float | None, ...] = ()
    """Per core; None for a core that is offline ("off" in tegrastats)."""
    power_mode: str | None = None
    source: str = ""

    def hottest(self, zones: Sequence[str] | None = None) -> tuple[str, float] | None:
        """(zone, C) of the hottest die zone, among ``zones`` when given (missing ones are
        skipped; if none of them is present, all die zones count)."""
        candidates = {k: v for k, v in self.temps_c.items() if k not in NOT_DIE_ZONES}
        if zones:
            chosen = {k: v for k, v in candidates.items() if k in zones}
            candidates = chosen or candidates
        if not candidates:
            return None
        zone = max(candidates, key=lambda k: candidates[k])
        return zone, candidates[zone]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["temps_c"] = dict(self.temps_c)
        d["rails_mw"] = dict(self.rails_mw)
        d["cpu_load_pct"] = list(self.cpu_load_pct)
        return d
