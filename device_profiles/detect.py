"""Which board is this? Read the device tree (``/proc/device-tree/model`` and ``compatible``)
and MemTotal, and match them against every profile's ``detect`` rule.

The compatible list names the module part number (``nvidia,p3767-0003``), which stays right on
third-party carrier boards whose model string is their own; the model string and MemTotal tell
apart the rest (e.g. AGX Orin 32GB vs 64GB share a dev kit name).
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from pathlib import Path

from device_profiles.catalog import ProfileError, list_profiles, load_profile
from device_profiles.schema import DeviceProfile

X86_MACHINES = {"x86_64", "amd64", "i686", "i386"}


@dataclass(frozen=True)
class Detection:
    profile: DeviceProfile
    reason: str
    """How it was decided, e.g. "compatible p3767-0005, MemTotal 7620 MB"."""


@dataclass(frozen=True)
class BoardFacts:
    model: str | None
    compatible: tuple[str, ...]
    mem_total_mb: int | None


def read_board_facts(root: Path = Path("/")) -> BoardFacts:
    def read(rel: str) -> bytes | None:
        try:
            return (root / rel).read_bytes()
        except OSError:
            return None

    raw_model = read("proc/device-tree/model")
    # Device tree strings are NUL-terminated; compatible is a NUL-separated list.
    model = raw_model.rstrip(b"\0").decode(errors="replace").strip() if raw_model else None
    raw_compat = read("proc/device-tree/compatible") or b""
    compatible = tuple(s.decode(errors="replace") for s in raw_compat.split(b"\0") if s)
    mem = None
    meminfo = read("proc/meminfo")
    if meminfo:
        m = re.search(rb"^MemTotal:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
        if m:
            mem = int(m.group(1)) // 1024
    return BoardFacts(model=model or None, compatible=compatible, mem_total_mb=mem)


def _mem_ok(profile: DeviceProfile, mem_mb: int | None) -> bool:
    rng = profile.detect.mem_total_mb
    return rng is None or mem_mb is None or rng[0] <= mem_mb <= rng[1]


def match(facts: BoardFacts, profiles: list[DeviceProfile]) -> Detection | None:
    """The best profile for ``facts``: a part-number hit beats a model-string hit; MemTotal
    must fit the profile's range either way."""
    compat = " ".join(facts.compatible)
    mem_note = f", MemTotal {facts.mem_total_mb} MB" if facts.mem_total_mb else ""
    for p in profiles:
        hit = next((c for c in p.detect.compatible if c in compat), None)
        if hit and _mem_ok(p, facts.mem_total_mb):
            return Detection(p, f"compatible {hit}{mem_note}")
    if facts.model:
        for p in profiles:
            hit = next(
                (pat for pat in p.detect.model_patterns if re.search(pat, facts.model, re.I)),
                None,
            )
            if hit and _mem_ok(p, facts.mem_total_mb):
                return Detection(p, f"model {facts.model!r} matches {hit!r}{mem_note}")
    return None


def detect(root: Path = Path("/"), machine: str | None = None) -> Detection:
    facts = read_board_facts(root)
    # Detectable profiles only: "sim" and "generic-x86" have no rules and are never matched.
    profiles = [load_profile(n) for n in list_profiles()]
    found = match(facts, [p for p in profiles if p.detect.model_patterns or p.detect.compatible])
    if found is not None:
        return found
    machine = (machine or platform.machine()).lower()
    if facts.model is None and machine in X86_MACHINES:
        return Detection(load_profile("generic-x86"), f"no device tree, machine {machine}")
    raise ProfileError(
        f"unknown board: model {facts.model!r}, compatible {list(facts.compatible)}, "
        f"MemTotal {facts.mem_total_mb} MB, machine {machine}; pass --profile NAME "
        f"(one of: {', '.join(list_profiles())})"
    )
