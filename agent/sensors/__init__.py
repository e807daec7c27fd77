"""Sensor backends behind one ``Reading``: jtop, tegrastats, sysfs, and the simulated plant.

    with open_backend("auto", profile=profile) as sensors:
        reading = sensors.read()

``auto`` tries the profile's backends in order (jtop, tegrastats, sysfs on Jetson) and takes
the first that works; each one that does not is logged once. A backend that breaks later
returns empty readings rather than raising (see ``backend.ReportOnce``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from agent.sensors.backend import SensorBackend, SensorUnavailable, empty_reading
from agent.sensors.reading import Reading
from device_profiles.schema import DeviceProfile

BACKENDS: tuple[str, ...] = ("auto", "jtop", "tegrastats", "sysfs", "sim")
log = logging.getLogger("agent.sensors")


def _make(name: str, profile: DeviceProfile | None, interval_s: float,
          sim_time_scale: float | None, root: Path, state_dir: Path | None) -> SensorBackend:
    if name == "jtop":
        from agent.sensors.jtop import JtopBackend

        return JtopBackend(interval_s=interval_s)
    if name == "tegrastats":
        from agent.sensors.tegrastats import TegrastatsBackend

        return TegrastatsBackend(interval_ms=max(10, int(interval_s * 1000)))
    if name == "sysfs":
        from agent.sensors.sysfs import SysfsBackend

        return SysfsBackend(root=root)
    if name == "sim":
        from agent.sensors.sim import open_sim

        return open_sim(profile, sim_time_scale, state_dir)
    raise ValueError(f"unknown sensor backend {name!r} (choose from {', '.join(BACKENDS)})")


def open_sensors(
    name: str = "auto",
    *,
    profile: DeviceProfile | None = None,
    interval_s: float = 0.5,
    sim_time_scale: float | None = None,
    root: Path = Path("/"),
    state_dir: Path | None = None,
) -> SensorBackend:
    """Open one backend; ``auto`` walks the profile's list (default: jtop, tegrastats, sysfs)
    and, when none works, returns a ``NullBackend``. A named backend that cannot work raises
    ``SensorUnavailable`` with the reason.

    ``sim`` with a ``state_dir`` reads that device's one simulated board, which the daemon and
    its jobs share (``agent.sensors.sim.SimBoard``); ``sim_time_scale`` (simulated seconds per
    wall second) and ``profile`` then become the board's, None keeps the board's own."""
    if name != "auto":
        return _make(name, profile, interval_s, sim_time_scale, root, state_dir)
    order = list(profile.sensors) if profile is not None else ["jtop", "tegrastats", "sysfs"]
    problems = []
    for candidate in order:
        try:
            backend = _make(candidate, profile, interval_s, sim_time_scale, root, state_dir)
        except SensorUnavailable as e:
            log.info("sensor backend %s unavailable: %s", candidate, e)
            problems.append(f"{candidate}: {e}")
            continue
        log.info("sensor backend: %s", candidate)
        return backend
    # Degrade, never crash: without temperatures the governor turns thermal pacing off and
    # says so once (a machine with no sensors has nothing to regulate against).
    log.warning("no sensor backend works here (%s); readings will be empty", "; ".join(problems))
    return NullBackend()


class NullBackend:
    """What ``auto`` returns when nothing works: empty readings, so pacing degrades safely."""

    name = "none"

    def read(self) -> Reading:
        return empty_reading(self.name)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def open_backend(
    name: str = "auto",
    *,
    profile: DeviceProfile | None = None,
    interval_s: float = 0.5,
    sim_time_scale: float | None = None,
    root: Path = Path("/"),
    state_dir: Path | None = None,
) -> Iterator[SensorBackend]:
    """``open_sensors`` as a context manager that closes the backend."""
    backend = open_sensors(
        name, profile=profile, interval_s=interval_s, sim_time_scale=sim_time_scale, root=root,
        state_dir=state_dir,
    )
    try:
        yield backend
    finally:
        backend.close()


__all__ = [
    "BACKENDS",
    "NullBackend",
    "Reading",
    "SensorBackend",
    "SensorUnavailable",
    "open_backend",
    "open_sensors",
]
