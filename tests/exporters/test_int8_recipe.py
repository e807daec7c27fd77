"""The host's ISA, read from recorded /proc/cpuinfo texts, and the INT8 recipe it calls for."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporters.cpu_isa import CpuIsa, detect_isa, parse_cpuinfo
from exporters.int8_recipe import TENSORRT_RECIPE, choose_recipe

DATA = Path(__file__).parent / "data"

# (file, arch, int8 dot products without saturation, recipe for ONNX Runtime)
HOSTS = [
    ("cpuinfo_epyc_milan_avx2.txt", "x86_64", False, "u8s8-reduce-range"),
    ("cpuinfo_xeon_icelake_vnni.txt", "x86_64", True, "s8s8-symmetric"),
    ("cpuinfo_core_alderlake_avxvnni.txt", "x86_64", True, "s8s8-symmetric"),
    ("cpuinfo_jetson_orin_nano.txt", "aarch64", True, "s8s8-symmetric"),
    ("cpuinfo_jetson_nano.txt", "aarch64", True, "s8s8-symmetric"),
]


@pytest.mark.parametrize(("name", "arch", "dot", "recipe"), HOSTS)
def test_recorded_hosts_get_their_recipe(name: str, arch: str, dot: bool, recipe: str) -> None:
    isa = parse_cpuinfo((DATA / name).read_text(), arch)
    assert isa.int8_dot is dot
    chosen = choose_recipe("onnxruntime", isa)
    assert chosen.name == recipe and isa.label in chosen.reason
    # TensorRT takes symmetric int8 whatever the host.
    assert choose_recipe("tensorrt", isa) == TENSORRT_RECIPE


def test_the_parsed_flags_and_labels() -> None:
    epyc = parse_cpuinfo((DATA / "cpuinfo_epyc_milan_avx2.txt").read_text(), "x86_64")
    assert epyc.model == "AMD EPYC" and epyc.flags == ("avx2",)
    assert epyc.label == "x86_64 avx2 (no VNNI)"
    xeon = parse_cpuinfo((DATA / "cpuinfo_xeon_icelake_vnni.txt").read_text(), "x86_64")
    assert "avx512_vnni" in xeon.flags and "(no VNNI)" not in xeon.label
    orin = parse_cpuinfo((DATA / "cpuinfo_jetson_orin_nano.txt").read_text(), "aarch64")
    assert orin.flags == ("asimddp",) and orin.label == "aarch64 asimddp"


def test_a_set_recipe_wins_except_u8s8_for_tensorrt() -> None:
    avx2 = CpuIsa("x86_64", "", ("avx2",))
    assert choose_recipe("onnxruntime", avx2, "s8s8-symmetric").name == "s8s8-symmetric"
    vnni = CpuIsa("x86_64", "", ("avx2", "avx512_vnni"))
    assert choose_recipe("onnxruntime", vnni, "u8s8-reduce-range").name == "u8s8-reduce-range"
    with pytest.raises(ValueError, match="TensorRT takes symmetric int8 only"):
        choose_recipe("tensorrt", vnni, "u8s8-reduce-range")


def test_unknown_hosts_fall_back_to_the_exact_symmetric_recipe(tmp_path: Path) -> None:
    isa = detect_isa(tmp_path / "no-cpuinfo")  # not Linux: the architecture alone
    assert isa.flags == ()
    riscv = CpuIsa("riscv64", "", ())
    assert choose_recipe("onnxruntime", riscv).name == "s8s8-symmetric"
