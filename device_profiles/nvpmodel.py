"""Power modes as the board defines them, read at run time from ``nvpmodel``.

Mode ids differ by board and JetPack release (the Orin Nano 8GB's 15W mode is id 0 everywhere,
but JetPack 6.2 "Super" numbers 25W=1, MAXN_SUPER=2, 7W=3), so ids are never hard-coded:
``nvpmodel -p --verbose`` lists them (``NVPM VERB: POWER_MODEL: ID=2 NAME=MAXN_SUPER``) and
``nvpmodel -q`` prints the active one (``NV Power Mode: 15W`` then its id on the next line).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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

    def __init__(self, profile: DeviceProfile, run: Runner = run_command) -> None:
        self.run = run
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
        set_mode(self.ids[name], self.run)
        self._current = name
