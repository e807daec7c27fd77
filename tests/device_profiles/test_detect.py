"""Board detection from fake device trees (model, compatible, MemTotal) in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_profiles import ProfileError, detect_profile
from device_profiles.detect import detect, read_board_facts


def fake_board(root: Path, model: str | None, compatible: list[str], mem_kb: int | None) -> Path:
    dt = root / "proc/device-tree"
    dt.mkdir(parents=True, exist_ok=True)
    if model is not None:
        (dt / "model").write_bytes(model.encode() + b"\0")  # NUL-terminated, as the kernel has it
    if compatible:
        (dt / "compatible").write_bytes(b"\0".join(c.encode() for c in compatible) + b"\0")
    if mem_kb is not None:
        (root / "proc/meminfo").write_text(f"MemTotal:       {mem_kb} kB\nMemFree: 1 kB\n")
    return root


CASES = [
    # model string, compatible, MemTotal kB -> profile
    ("NVIDIA Jetson Orin Nano Developer Kit",
     ["nvidia,p3768-0000+p3767-0005", "nvidia,p3767-0005", "nvidia,tegra234"], 7802720,
     "jetson-orin-nano-8gb"),
    ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
     ["nvidia,p3768-0000+p3767-0005-super", "nvidia,p3767-0005", "nvidia,tegra234"], 7802720,
     "jetson-orin-nano-8gb"),
    ("NVIDIA Jetson Orin Nano Developer Kit", ["nvidia,p3767-0004", "nvidia,tegra234"], 3552000,
     "jetson-orin-nano-4gb"),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
     ["nvidia,p3768-0000+p3767-0000", "nvidia,p3767-0000", "nvidia,tegra234"], 15751000,
     "jetson-orin-nx-16gb"),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
     ["nvidia,p3768-0000+p3767-0001", "nvidia,p3767-0001", "nvidia,tegra234"], 7802720,
     "jetson-orin-nx-8gb"),
    # Same dev kit name for 32GB and 64GB: the part number, then MemTotal, decide.
    ("NVIDIA Jetson AGX Orin Developer Kit",
     ["nvidia,p3737-0000+p3701-0005", "nvidia,p3701-0005", "nvidia,tegra234"], 64302000,
     "jetson-agx-orin-64gb"),
    ("NVIDIA Jetson AGX Orin Developer Kit",
     ["nvidia,p3737-0000+p3701-0000", "nvidia,p3701-0000", "nvidia,tegra234"], 31269000,
     "jetson-agx-orin-32gb"),
    ("NVIDIA Jetson AGX Orin Developer Kit", [], 64302000, "jetson-agx-orin-64gb"),
    ("NVIDIA Jetson Xavier NX Developer Kit", ["nvidia,p3509-0000+p3668-0001",
     "nvidia,jetson-xavier-nx", "nvidia,tegra194"], 7958000, "jetson-xavier-nx"),
    ("NVIDIA Jetson Nano Developer Kit", ["nvidia,p3449-0000-b00+p3448-0002",
     "nvidia,jetson-nano", "nvidia,tegra210"], 4059000, "jetson-nano"),
    # A third-party carrier with its own model string: the module part number still tells.
    ("Seeed reComputer J4012", ["seeed,recomputer-j401", "nvidia,p3767-0000", "nvidia,tegra234"],
     15751000, "jetson-orin-nx-16gb"),
]


@pytest.mark.parametrize(("model", "compatible", "mem_kb", "expected"), CASES)
def test_detect(tmp_path: Path, model: str, compatible: list[str], mem_kb: int,
                expected: str) -> None:
    root = fake_board(tmp_path, model, compatible, mem_kb)
    found = detect(root=root, machine="aarch64")
    assert found.profile.name == expected, found.reason
    assert detect_profile(root=root, machine="aarch64").name == expected


def test_facts_strip_the_nul(tmp_path: Path) -> None:
    facts = read_board_facts(fake_board(tmp_path, "NVIDIA Jetson Nano Developer Kit",
                                        ["nvidia,jetson-nano", "nvidia,tegra210"], 4059000))
    assert facts.model == "NVIDIA Jetson Nano Developer Kit"
    assert facts.compatible == ("nvidia,jetson-nano", "nvidia,tegra210")
    assert facts.mem_total_mb == 4059000 // 1024


def test_x86_without_device_tree_is_generic(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 32000000 kB\n")
    found = detect(root=tmp_path, machine="x86_64")
    assert found.profile.name == "generic-x86"
    assert "no device tree" in found.reason


def test_unknown_arm_board_says_what_it_saw(tmp_path: Path) -> None:
    root = fake_board(tmp_path, "Raspberry Pi 5 Model B Rev 1.0", ["raspberrypi,5-model-b"],
                      8000000)
    with pytest.raises(ProfileError, match=r"unknown board: model 'Raspberry Pi 5.*--profile NAME"):
        detect(root=root, machine="aarch64")


def test_memory_outside_every_range_is_unknown(tmp_path: Path) -> None:
    root = fake_board(tmp_path, "NVIDIA Jetson AGX Orin Developer Kit", [], 1000000)
    with pytest.raises(ProfileError, match="unknown board"):
        detect(root=root, machine="aarch64")
