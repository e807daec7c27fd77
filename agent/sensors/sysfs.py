"""Sensors straight from the kernel: thermal zones, INA3221 power rails (Jetson), hwmon and
RAPL (x86), /proc/meminfo, the Jetson GPU load file and the nvpmodel status file.

Everything is read below ``root`` so tests can build a fake tree in a temporary directory.
Thermal zones are looked up by their ``type``, never by number (numbering differs by board and
release). On Orin NX/Nano the INA3221 reports ``VDD_IN`` (the total) next to the rails it
feeds; on AGX Orin there is no total rail and the rails are summed (see ``total_power_mw``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from agent.sensors.backend import ReportOnce, SensorUnavailable
from agent.sensors.reading import OFFLINE_BELOW_C, Reading, total_power_mw, zone_key
from device_profiles.nvpmodel import parse_modes

GPU_LOAD_FILES = ("sys/devices/platform/gpu.0/load", "sys/devices/gpu.0/load")
X86_TEMP_CHIPS = frozenset({"coretemp", "k10temp", "zenpower"})


def _read_text(path: Path) -> str:
    return path.read_text().strip()


class SysfsBackend:
    name = "sysfs"

    def __init__(self, root: Path = Path("/"), clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.clock = clock
        self._report = ReportOnce(self.name)
        self._rapl_last: dict[str, tuple[float, int]] = {}
        self._zones = sorted((root / "sys/class/thermal").glob("thermal_zone*"))
        self._hwmon = sorted((root / "sys/class/hwmon").glob("hwmon*"))
        self._iio = sorted((root / "sys/bus/i2c/drivers/ina3221x").glob("*/iio:device*"))
        self._rapl = sorted(
            p for p in (root / "sys/class/powercap").glob("intel-rapl:*")
            if re.fullmatch(r"intel-rapl:\d+", p.name)
        )
        if not (self._zones or self._hwmon or self._iio or (root / "proc/meminfo").exists()):
            raise SensorUnavailable(f"no thermal zones, hwmon or /proc/meminfo under {root}")

    # -- temperatures -------------------------------------------------------------------------

    def _temps(self) -> dict[str, float]:
        temps: dict[str, float] = {}
        for zone in self._zones:
            try:
                kind = _read_text(zone / "type")
                value = int(_read_text(zone / "temp")) / 1000.0
            except (OSError, ValueError) as e:
                # A power-gated GPU zone fails reads (EAGAIN/ENODATA) on Orin: expected, quiet.
                self._report(f"zone:{zone.name}", "%s unreadable (%s); skipped", zone, e)
                continue
            if value > OFFLINE_BELOW_C:
                temps[zone_key(kind)] = value
        for chip in self._hwmon:
            name = self._chip_name(chip)
            if name not in X86_TEMP_CHIPS:
                continue
            for inp in sorted(chip.glob("temp*_input")):
                label_file = inp.with_name(inp.name.replace("_input", "_label"))
                try:
                    label = _read_text(label_file) if label_file.exists() else inp.name[:-6]
                    temps[zone_key(f"{name}_{label}")] = int(_read_text(inp)) / 1000.0
                except (OSError, ValueError) as e:
                    self._report(f"hwmon:{inp}", "%s unreadable (%s); skipped", inp, e)
        return temps

    def _chip_name(self, chip: Path) -> str:
        try:
            return _read_text(chip / "name")
        except OSError:
            return ""

    # -- power --------------------------------------------------------------------------------

    def _ina3221_hwmon(self) -> dict[str, float]:
        rails: dict[str, float] = {}
        for chip in self._hwmon:
            if not self._chip_name(chip).startswith("ina3221"):
                continue
            for label_file in sorted(chip.glob("in*_label")):
                idx = label_file.name[2:].split("_")[0]
                try:
                    label = _read_text(label_file)
                    if label == "NC":
                        continue
                    mv = int(_read_text(chip / f"in{idx}_input"))
                    ma = int(_read_text(chip / f"curr{idx}_input"))
                except (OSError, ValueError) as e:
                    self._report(f"ina:{label_file}", "rail %s unreadable (%s)", label_file, e)
                    continue
                rails[label] = mv * ma / 1000.0
        return rails

    def _ina3221_iio(self) -> dict[str, float]:
        """JetPack 4 exposes the same chip through iio: rail_name_N and in_power N_input (mW)."""
        rails: dict[str, float] = {}
        for dev in self._iio:
            for name_file in sorted(dev.glob("rail_name_*")):
                idx = name_file.name.rsplit("_", 1)[1]
                try:
                    rails[_read_text(name_file)] = float(_read_text(dev / f"in_power{idx}_input"))
                except (OSError, ValueError) as e:
                    self._report(f"iio:{name_file}", "rail %s unreadable (%s)", name_file, e)
        return rails

    def _rapl_mw(self, now: float) -> dict[str, float]:
        """RAPL counts energy (uJ); power is the difference between two reads, so the first
        read of a zone yields nothing. The counter wraps at max_energy_range_uj."""
        rails: dict[str, float] = {}
        for zone in self._rapl:
            try:
                name = _read_text(zone / "name")
                energy = int(_read_text(zone / "energy_uj"))
            except (OSError, ValueError) as e:
                # energy_uj is root-only on kernels patched for CVE-2020-8694.
                self._report(f"rapl:{zone.name}", "%s unreadable (%s); no CPU power", zone, e)
                continue
            key = f"RAPL_{name.upper().replace('-', '_')}"
            last = self._rapl_last.get(key)
            self._rapl_last[key] = (now, energy)
            if last is None or now <= last[0]:
                continue
            delta = energy - last[1]
            if delta < 0:
                try:
                    delta += int(_read_text(zone / "max_energy_range_uj"))
                except (OSError, ValueError):
                    continue
            rails[key] = delta / (now - last[0]) / 1000.0
        if "RAPL_PSYS" in rails:  # platform power already contains the packages
            return {"RAPL_PSYS": rails["RAPL_PSYS"]}
        return rails

    # -- memory, GPU, power mode ----------------------------------------------------------------

    def _meminfo(self) -> dict[str, float]:
        try:
            text = (self.root / "proc/meminfo").read_text()
        except OSError as e:
            self._report("meminfo", "/proc/meminfo unreadable (%s)", e)
            return {}
        return {k: int(v) / 1024.0 for k, v in re.findall(r"^(\w+):\s+(\d+)\s*kB", text, re.M)}

    def _gpu_load(self) -> float | None:
        for rel in GPU_LOAD_FILES:
            path = self.root / rel
            if path.exists():
                try:
                    return int(_read_text(path)) / 10.0  # per mille
                except (OSError, ValueError) as e:
                    self._report("gpu", "%s unreadable (%s)", path, e)
        return None

    def _power_mode(self) -> str | None:
        status = self.root / "var/lib/nvpmodel/status"
        if not status.exists():
            return None
        try:
            m = re.search(r"pmode:\s*(\d+)", status.read_text())
            conf = (self.root / "etc/nvpmodel.conf").read_text()
        except OSError as e:
            self._report("nvpmodel", "power mode unreadable (%s)", e)
            return None
        if not m:
            return None
        mode_id = int(m.group(1))
        return next((mode.name for mode in parse_modes(conf).modes if mode.id == mode_id), None)

    def read(self) -> Reading:
        now = self.clock()
        rails = self._ina3221_hwmon() or self._ina3221_iio()
        rails.update(self._rapl_mw(now))
        mem = self._meminfo()
        total = mem.get("MemTotal")
        avail = mem.get("MemAvailable")
        swap_total = mem.get("SwapTotal")
        swap_free = mem.get("SwapFree")
        return Reading(
            timestamp_s=now,
            temps_c=self._temps(),
            rails_mw=rails,
            total_power_mw=total_power_mw(rails),
            ram_used_mb=total - avail if total is not None and avail is not None else None,
            ram_total_mb=total,
            swap_used_mb=(
                swap_total - swap_free if swap_total is not None and swap_free is not None else None
            ),
            swap_total_mb=swap_total,
            nvmap_used_mb=mem.get("NvMapMemUsed"),
            gpu_load_pct=self._gpu_load(),
            power_mode=self._power_mode(),
            source=self.name,
        )

    def close(self) -> None:
        pass
