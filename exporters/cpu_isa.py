"""Which integer dot-product instructions this CPU has: what decides the INT8 recipe.

ONNX Runtime's CPU kernels (MLAS) multiply u8 activations by s8 weights. On x86 without
VNNI they do it with ``vpmaddubsw``, which adds each pair of 8-bit products in a *saturating*
16-bit lane: two products of 255 x 127 overflow it. With VNNI (``vpdpbusd``: AVX-512 VNNI or
the VEX-encoded AVX-VNNI) the pair goes straight into 32 bits, and on 64-bit ARM the NEON
kernels widen every product (``sdot``/``udot`` with the dot-product extension), so neither
saturates. The recipe that is both fast and exact therefore depends on the host, and is
chosen from what this module reports (``exporters.int8_recipe``).

Torch-free and ONNX-free: it reads ``/proc/cpuinfo`` (Linux, where every Jetson and every
CI host runs) and falls back to ``platform.machine()`` elsewhere.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# Flags as the Linux kernel names them in /proc/cpuinfo.
X86_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")
ARM_DOT = ("asimddp",)


@dataclass(frozen=True)
class CpuIsa:
    arch: str
    """x86_64 | aarch64 | another ``platform.machine()`` value."""
    model: str
    """The CPU's model name, as the kernel reports it ('' when unknown)."""
    flags: tuple[str, ...]
    """The flags that matter for INT8 (a subset of the CPU's flags), sorted."""

    @property
    def int8_dot(self) -> bool:
        """True when int8 products accumulate without a saturating 16-bit step."""
        if self.arch == "x86_64":
            return any(f in self.flags for f in X86_VNNI)
        # 64-bit ARM: NEON kernels widen every product, with or without the dot extension.
        return self.arch == "aarch64"

    @property
    def label(self) -> str:
        """A short human name, e.g. 'x86_64 avx2 (no VNNI)' or 'aarch64 asimddp'."""
        shown = " ".join(self.flags) or "baseline"
        if self.arch == "x86_64" and not self.int8_dot:
            shown += " (no VNNI)"
        return f"{self.arch} {shown}"

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "int8_dot": self.int8_dot, "label": self.label}


_INTERESTING = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "i8mm", "sve",
                *X86_VNNI, *ARM_DOT)


def parse_cpuinfo(text: str, arch: str) -> CpuIsa:
    """The ISA described by a ``/proc/cpuinfo`` text (the first processor is enough: Linux
    lists the flags every core shares on x86, and Jetson cores are alike)."""
    model, flags = "", set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return CpuIsa(arch=arch, model=model,
                  flags=tuple(sorted(f for f in flags if f in _INTERESTING)))


def _arch(machine: str) -> str:
    m = machine.lower()
    if m in ("amd64", "x86_64", "x64"):
        return "x86_64"
    if m in ("arm64", "aarch64"):
        return "aarch64"
    return m


def detect_isa(cpuinfo: Path = CPUINFO) -> CpuIsa:
    """This host's ISA."""
    arch = _arch(platform.machine())
    try:
        return parse_cpuinfo(cpuinfo.read_text(errors="replace"), arch)
    except OSError:  # not Linux: the architecture alone (macOS arm64 has the dot extension)
        return CpuIsa(arch=arch, model=platform.processor(), flags=())
