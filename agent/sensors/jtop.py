"""jetson-stats (``jtop``): talks to the root ``jtop`` service over /run/jtop.sock.

``parse_stats`` turns one ``jetson.stats`` dict into a Reading; it is pure and tested on a
recorded dict. Keys used: ``Temp <zone>`` (C; -256 = offline), ``Power <rail>`` and
``Power TOT`` (mW), ``RAM``/``SWAP`` (fractions of the totals), ``GPU`` (%), ``CPU1..N``
(% or 'OFF'), and the power mode under the literal key ``'nvp model'``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from agent.sensors.backend import ReportOnce, SensorUnavailable, empty_reading
from agent.sensors.reading import OFFLINE_BELOW_C, Reading, total_power_mw, zone_key


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def parse_stats(
    stats: Mapping[str, Any],
    *,
    ram_total_mb: float | None = None,
    swap_total_mb: float | None = None,
    nvmap_used_mb: float | None = None,
) -> Reading:
    """One ``jetson.stats`` dict -> Reading. RAM and SWAP come as fractions, so the totals
    (from ``jetson.memory``) are needed to report megabytes."""
    temps: dict[str, float] = {}
    rails: dict[str, float] = {}
    cores: list[tuple[int, float | None]] = []
    for key, value in stats.items():
        if key.startswith("Temp "):
            t = _num(value)
            if t is not None and t > OFFLINE_BELOW_C:
                temps[zone_key(key[5:])] = t
        elif key.startswith("Power ") and key != "Power TOT":
            p = _num(value)
            if p is not None:
                rails[key[6:]] = p
        elif key.startswith("CPU") and key[3:].isdigit():
            cores.append((int(key[3:]), _num(value)))  # 'OFF' -> None
    total = _num(stats.get("Power TOT"))
    if total is None:
        total = total_power_mw(rails)
    ram_frac = _num(stats.get("RAM"))
    swap_frac = _num(stats.get("SWAP"))
    stamp = stats.get("time")
    mode = stats.get("nvp model")
    return Reading(
        timestamp_s=stamp.timestamp() if isinstance(stamp, datetime) else time.time(),
        temps_c=temps,
        rails_mw=rails,
        total_power_mw=total,
        ram_used_mb=ram_frac * ram_total_mb if ram_frac is not None and ram_total_mb else None,
        ram_total_mb=ram_total_mb,
        swap_used_mb=(
            swap_frac * swap_total_mb if swap_frac is not None and swap_total_mb else None
        ),
        swap_total_mb=swap_total_mb,
        nvmap_used_mb=nvmap_used_mb,
        gpu_load_pct=_num(stats.get("GPU")),
        cpu_load_pct=tuple(v for _, v in sorted(cores)),
        power_mode=str(mode) if mode is not None else None,
        source="jtop",
    )


class JtopBackend:
    """Live jtop connection. Needs ``pip install jetson-stats`` and its service running."""

    name = "jtop"

    def __init__(self, interval_s: float = 0.5) -> None:
        try:
            from jtop import jtop  # type: ignore[import-not-found]
        except ImportError as e:
            raise SensorUnavailable(
                "jetson-stats is not installed (pip install jetson-stats)"
            ) from e
        self._report = ReportOnce(self.name)
        try:
            self._jetson = jtop(interval=interval_s)
            self._jetson.start()
        except Exception as e:  # jtop raises its own JtopException when the service is down
            raise SensorUnavailable(f"cannot connect to the jtop service: {e}") from e

    def read(self) -> Reading:
        try:
            if not self._jetson.ok():
                self._report("ok", "jtop stopped answering; readings are empty")
                return empty_reading(self.name)
            memory = self._jetson.memory
            ram = memory.get("RAM", {})
            swap = memory.get("SWAP", {})
            return parse_stats(
                self._jetson.stats,
                ram_total_mb=ram.get("tot", 0) / 1024 or None,  # jtop reports kB
                swap_total_mb=swap.get("tot", 0) / 1024 or None,
                # jtop's "shared" RAM is what the GPU holds (NvMap) on Jetson.
                nvmap_used_mb=ram.get("shared", 0) / 1024 if "shared" in ram else None,
            )
        except Exception as e:  # any jtop failure degrades to an empty reading, never raises
            self._report("read", "jtop read failed (%s); readings are empty", e)
            return empty_reading(self.name)

    def close(self) -> None:
        try:
            self._jetson.close()
        except Exception as e:
            self._report("close", "jtop close failed (%s)", e)
