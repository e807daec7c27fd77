"""Power modes as the board defines them, read at run time from ``nvpmodel``.

Mode ids differ by board and JetPack release (the Orin Nano 8GB's 15W mode is id 0 everywhere,
but JetPack 6.2 "Super" numbers 25W=1, MAXN_SUPER=2, 7W=3), so ids are never hard-coded:
``nvpmodel -p --verbose`` lists them (``NVPM VERB: POWER_MODEL: ID=2 NAME=MAXN_SUPER``) and
``nvpmodel -q`` prints the active one (``NV Power Mode: 15W`` then its id on the next line).

Switching (``nvpmodel -m``) needs root, and the hardened ``edge-agent`` unit has none (no
capabilities, ``NoNewPrivileges``, so no sudo either). :func:`mode_setter` picks the way that
works: ``nvpmodel -m`` when running as root; else the jetson-stats service, which runs as root
and lets members of the ``jtop`` group set the power mode over ``/run/jtop.sock``
(``systemd/install.sh`` adds the service user to that group where it exists); else none, and
the caller says why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from device_profiles.schema import DeviceProfile

_MODE_RE = re.compile(r"POWER_MODEL:?\s+ID=(?P<id>\d+)\s+NAME=(?P<name>[^\s>]+)")
_DEFAULT_RE = re.compile(r"PM_CONFIG:\s+DEFAULT=(?P<name>[^\s(]+)\((?P<id>\d+)\)")
_ACTIVE_RE = re.compile(r"NV Power Mode:\s*(?P<name>\S+)")

Runner = Callable[[Sequence[str]], str]
"""Runs a command and returns its stdout + stderr; raises OSError when it cannot run."""


class NvpmodelError(RuntimeError):
    pass


@dataclass(frozen=True)
class NvpMode:
    id: int
    name: str


@dataclass(frozen=True)
class NvpModelInfo:
    modes: tuple[NvpMode, ...]
    default: NvpMode | None

    def id_of(self, name: str) -> int | None:
        return next((m.id for m in self.modes if m.name == name), None)


def parse_modes(text: str) -> NvpModelInfo:
    """Parse ``nvpmodel -p --verbose`` output (also accepts /etc/nvpmodel.conf itself)."""
    modes: dict[int, NvpMode] = {}
    for m in _MODE_RE.finditer(text):
        mode = NvpMode(int(m.group("id")), m.group("name"))
        modes.setdefault(mode.id, mode)
    d = _DEFAULT_RE.search(text)
    default = NvpMode(int(d.group("id")), d.group("name")) if d else None
    return NvpModelInfo(tuple(sorted(modes.values(), key=lambda m: m.id)), default)


def parse_query(text: str) -> NvpMode | None:
    """Parse ``nvpmodel -q``: the line ``NV Power Mode: NAME`` and the id on the next line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _ACTIVE_RE.search(line)
        if m:
            for follow in lines[i + 1 :]:
                if follow.strip().isdigit():
                    return NvpMode(int(follow.strip()), m.group("name"))
            return None
    return None


def run_command(argv: Sequence[str], timeout_s: float = 10.0) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    out = done.stdout + done.stderr
    if done.returncode != 0 or "NVPM ERROR" in out:
        raise NvpmodelError(f"{' '.join(argv)} failed (exit {done.returncode}): {out.strip()}")
    return out


def available() -> bool:
    return shutil.which("nvpmodel") is not None


def read_modes(run: Runner = run_command) -> NvpModelInfo:
    return parse_modes(run(["nvpmodel", "-p", "--verbose"]))


def read_active(run: Runner = run_command) -> NvpMode | None:
    return parse_query(run(["nvpmodel", "-q"]))


def set_mode(mode_id: int, run: Runner = run_command) -> None:
    """Switch power mode (needs root). Modes that change GPU power gating need a reboot."""
    run(["nvpmodel", "-m", str(mode_id)])


JTOP_SOCKET = Path("/run/jtop.sock")


class ModeSetter(Protocol):
    name: str

    def set(self, mode_id: int) -> None: ...


class NvpmodelSetter:
    """``nvpmodel -m ID``, as root."""

    name = "nvpmodel"

    def __init__(self, run: Runner = run_command) -> None:
        self.run = run

    def set(self, mode_id: int) -> None:
        set_mode(mode_id, self.run)


class JtopSetter:
    """Through the jetson-stats service: ``jetson.nvpmodel = ID`` on a ``jtop`` connection
    (the service, root, runs nvpmodel; the client needs the ``jtop`` group only)."""

    name = "jtop"

    def __init__(self, connect: Callable[[], Any] | None = None) -> None:
        if connect is None:
            from jtop import jtop  # jetson-stats, the Jetson extra

            connect = jtop
        self.connect = connect

    def set(self, mode_id: int) -> None:
        with self.connect() as jetson:
            if not jetson.ok():
                raise NvpmodelError("the jtop service did not answer (/run/jtop.sock)")
            jetson.nvpmodel = mode_id
            now = jetson.nvpmodel
            got = getattr(now, "id", now)
            if isinstance(got, int) and got != mode_id:
                raise NvpmodelError(f"jtop set power mode {mode_id}, the board reports {got}")


def mode_setter(*, euid: int | None = None, socket: Path = JTOP_SOCKET,
                run: Runner = run_command) -> tuple[ModeSetter | None, str]:
    """The way this process can switch power modes, and how it was chosen (or why none)."""
    if not available():
        return None, "this board has no nvpmodel: power modes are not available"
    if (os.geteuid() if euid is None else euid) == 0:
        return NvpmodelSetter(run), "nvpmodel -m (running as root)"
    try:
        setter = JtopSetter()
    except ImportError:
        return None, ("not root, and jetson-stats is not installed (pip install "
                      "'edgetrain[jetson]'; its jtop service switches modes for the jtop group)")
    if not socket.exists():
        return None, (f"not root, and the jtop service is not running ({socket} is absent: "
                      "systemctl enable --now jtop)")
    if not os.access(socket, os.R_OK | os.W_OK):
        return None, (f"not root, and this user may not use {socket}: add it to the jtop "
                      "group (systemd/install.sh does) and restart the service")
    return setter, f"the jtop service ({socket})"


def usable_modes(profile: DeviceProfile, info: NvpModelInfo) -> dict[str, int]:
    """Profile modes this board actually offers, name -> id (as read from nvpmodel)."""
    found = {}
    for mode in profile.power_modes:
        mode_id = info.id_of(mode.name)
        if mode_id is not None:
            found[mode.name] = mode_id
    return found


class NvpmodelSwitcher:
    """Power-mode switching on a real board for the governor (``PowerModeSwitcher``): the
    modes it offers are the profile's modes this board's nvpmodel knows, by id read here."""

    def __init__(self, profile: DeviceProfile, run: Runner = run_command,
                 setter: ModeSetter | None = None) -> None:
        self.run = run
        self.setter: ModeSetter = setter or NvpmodelSetter(run)
        self.profile = profile
        self.ids = usable_modes(profile, read_modes(run))
        if not self.ids:
            raise NvpmodelError(f"nvpmodel lists none of {profile.name}'s power modes")
        active = read_active(run)
        self._current = active.name if active else None

    def current(self) -> str | None:
        return self._current

    def available(self) -> list[str]:
        return [n for n in self.ids if not self.profile.mode(n).needs_reboot]

    def switch(self, name: str) -> None:
        if name not in self.ids:
            raise NvpmodelError(f"power mode {name!r} is not available here: {sorted(self.ids)}")
        self.setter.set(self.ids[name])
        self._current = name
