"""tegrastats: a parser for every line format from JetPack 4 to 7, and a backend that runs
``tegrastats --interval N`` and keeps its latest line.

Format drift the parser absorbs (field facts, see the test data for real lines):
- optional ``MM-DD-YYYY HH:MM:SS`` prefix (JetPack 5+);
- GPU ``GR3D_FREQ 0%@76`` -> ``0%@[305,305]`` (one clock per GPC) -> ``12%@[1300,1300]``;
  JetPack 5.0 on AGX Orin printed ``GR3D_FREQ 0%@0 GR3D2_FREQ 0%@0``; without root only
  ``GR3D_FREQ 0%``; JetPack 7 (Thor) prints no GR3D field at all;
- rails ``POM_5V_IN 4520/4680`` (mW, no unit) -> ``VDD_IN 5251mW/8535mW`` (current/average)
  -> three values on JetPack 7; AGX Xavier names rails without a prefix (``GPU 0/0 CPU 155/155``);
  unwired INA3221 channels read ``NC``;
- temperatures ``CPU@40C`` -> ``cpu@46.125C`` -> ``cpu@52.9C/52.9C`` (current/max, JetPack 7);
  ``-256C`` is an offline sensor; ``PMIC@100C`` is a placeholder;
- CPU cores ``[9%@102,off,off]``, very old ``cpu [17%,13%]@408``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable

from agent.sensors.backend import ReportOnce, SensorUnavailable, empty_reading
from agent.sensors.reading import OFFLINE_BELOW_C, Reading, total_power_mw, zone_key

_STAMP_RE = re.compile(r"^\s*\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2}\s+")
_UNIT_MB = {"kB": 1 / 1024, "KB": 1 / 1024, "MB": 1.0, "GB": 1024.0}
_MEM_RE = re.compile(r"\b(RAM|SWAP) (\d+)/(\d+)(kB|KB|MB|GB)")
_CPU_RE = re.compile(r"\bCPU \[([^\]]*)\]", re.IGNORECASE)
_GPU_RE = re.compile(r"\bGR3D2?(?:_FREQ)? (\d+)%(?:@(\[[\d,]*\]|\d+))?")
# A temperature: name@valueC, on JetPack 7 name@currentC/maxC.
_TEMP_RE = re.compile(
    r"(?<![\w@])([A-Za-z][\w-]*)@(-?\d+(?:\.\d+)?)C(?:/(-?\d+(?:\.\d+)?)C)?(?!\w)"
)
# A rail: upper-case name then 2 or 3 slash-separated numbers, each optionally in mW. The
# lookahead stops RAM/SWAP (which end in MB/kB) from matching.
_RAIL_RE = re.compile(
    r"(?<![\w@])([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?(?:/(\d+)(?:mW)?)?(?![\w/])"
)
_NOT_RAILS = frozenset({"RAM", "SWAP", "IRAM"})


def _cores(body: str) -> tuple[float | None, ...]:
    """Per-core load; an ``off`` core is None. The old ``[...]@Z`` form's shared clock is
    not kept: nothing downstream uses CPU clocks."""
    loads: list[float | None] = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() == "off":
            loads.append(None)
            continue
        m = re.match(r"(\d+)%", item)
        loads.append(float(m.group(1)) if m else None)
    return tuple(loads)


def parse_line(line: str, timestamp_s: float | None = None) -> Reading:
    """Parse one tegrastats line. Unknown fields are ignored, missing ones stay None."""
    text = _STAMP_RE.sub("", line.strip())
    mem: dict[str, tuple[float, float]] = {}
    for name, used, total, unit in _MEM_RE.findall(text):
        scale = _UNIT_MB[unit]
        mem[name] = (int(used) * scale, int(total) * scale)

    cpu = _CPU_RE.search(text)
    cores = _cores(cpu.group(1)) if cpu else ()

    gpu_load = gpu_freq = None
    for load, freq in _GPU_RE.findall(text):
        gpu_load = max(gpu_load or 0.0, float(load))
        clocks = [int(f) for f in re.findall(r"\d+", freq)]
        if clocks:
            gpu_freq = max(gpu_freq or 0.0, float(max(clocks)))

    temps: dict[str, float] = {}
    for name, current, _peak in _TEMP_RE.findall(text):
        value = float(current)
        if value > OFFLINE_BELOW_C:
            temps[zone_key(name)] = value

    rails: dict[str, float] = {}
    for name, current, _avg, _third in _RAIL_RE.findall(text):
        if name not in _NOT_RAILS and name != "NC":
            rails[name] = float(current)

    ram = mem.get("RAM")
    swap = mem.get("SWAP")
    return Reading(
        timestamp_s=time.time() if timestamp_s is None else timestamp_s,
        temps_c=temps,
        rails_mw=rails,
        total_power_mw=total_power_mw(rails),
        ram_used_mb=ram[0] if ram else None,
        ram_total_mb=ram[1] if ram else None,
        swap_used_mb=swap[0] if swap else None,
        swap_total_mb=swap[1] if swap else None,
        gpu_load_pct=gpu_load,
        gpu_freq_mhz=gpu_freq,
        cpu_load_pct=cores,
        source="tegrastats",
    )


class TegrastatsBackend:
    """Runs ``tegrastats --interval N`` in the background; ``read()`` parses its latest line.

    If tegrastats dies, that is reported once and ``read()`` returns empty readings."""

    name = "tegrastats"

    def __init__(
        self,
        interval_ms: int = 500,
        command: str = "tegrastats",
        popen: Callable[..., subprocess.Popen[str]] = subprocess.Popen,
    ) -> None:
        exe = shutil.which(command)
        if exe is None:
            raise SensorUnavailable(f"{command} not found on PATH (it ships with JetPack)")
        self._report = ReportOnce(self.name)
        self._latest: str | None = None
        self._lock = threading.Lock()
        self._proc = popen(
            [exe, "--interval", str(interval_ms)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self._thread = threading.Thread(target=self._pump, name="tegrastats", daemon=True)
        self._thread.start()
        # Wait for the first line so the first read() has data.
        deadline = time.monotonic() + max(2.0, 4 * interval_ms / 1000)
        while self._latest is None and time.monotonic() < deadline and self._proc.poll() is None:
            time.sleep(0.02)
        if self._latest is None:
            self.close()
            raise SensorUnavailable(f"{command} printed nothing within {deadline:.0f} s")

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.strip():
                with self._lock:
                    self._latest = line

    def read(self) -> Reading:
        if self._proc.poll() is not None:
            self._report(
                "exited", "tegrastats exited (code %s); readings are empty", self._proc.returncode
            )
            return empty_reading(self.name)
        with self._lock:
            line = self._latest
        if line is None:
            return empty_reading(self.name)
        try:
            return parse_line(line)
        except (ValueError, KeyError) as e:  # a line we cannot read must not stop training
            self._report("parse", "unreadable line %r (%s)", line[:120], e)
            return empty_reading(self.name)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
