"""Every board profile loads and says what the field facts say; bad YAML fails with the field
path and a fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from device_profiles import ProfileError, list_profiles, load_profile, load_profile_file

BOARDS = [
    "jetson-agx-orin-64gb", "jetson-agx-orin-32gb", "jetson-orin-nx-16gb", "jetson-orin-nx-8gb",
    "jetson-orin-nano-8gb", "jetson-orin-nano-4gb", "jetson-xavier-nx", "jetson-nano",
    "generic-x86", "sim",
]
ORIN = [b for b in BOARDS if "orin" in b]


def test_all_boards_present_and_valid() -> None:
    assert sorted(list_profiles()) == sorted(BOARDS)
    for name in BOARDS:
        p = load_profile(name)
        assert p.name == name
        assert p.memory.training_budget_mb < p.memory.total_mb
        assert p.plant.sources, f"{name}: plant parameters need their sources"


@pytest.mark.parametrize("name", ORIN)
def test_orin_facts(name: str) -> None:
    p = load_profile(name)
    assert p.thermal.board_throttle_c == 99.0  # upstream T234 device tree
    assert p.thermal.critical_c == 104.5
    assert p.thermal.throttle_target_c < p.thermal.soft_pause_c < 99.0
    assert p.precision.bf16 and p.precision.fp16 and p.precision.int8
    assert p.tensorrt.gpu_arch == "ampere" and p.tensorrt.sparsity_2_4
    assert p.tensorrt.compute_capability == "8.7"


@pytest.mark.parametrize("name", ["jetson-xavier-nx", "jetson-nano"])
def test_pre_ampere_boards_have_fp16_only(name: str) -> None:
    p = load_profile(name)
    assert p.precision.fp16 and not p.precision.bf16
    assert not p.tensorrt.sparsity_2_4


def test_dla_counts_and_memory() -> None:
    dla = {n: load_profile(n).tensorrt.dla_cores for n in BOARDS}
    assert dla["jetson-agx-orin-64gb"] == dla["jetson-orin-nx-16gb"] == 2
    assert dla["jetson-orin-nx-8gb"] == 1
    assert dla["jetson-orin-nano-8gb"] == dla["jetson-orin-nano-4gb"] == dla["jetson-nano"] == 0
    assert load_profile("jetson-agx-orin-64gb").memory.total_mb == 65536
    assert not load_profile("jetson-nano").precision.int8  # Maxwell: no fast INT8


def test_orin_nano_super_modes() -> None:
    p = load_profile("jetson-orin-nano-8gb")
    modes = {m.name: m for m in p.power_modes}
    assert set(modes) == {"15W", "7W", "25W", "MAXN_SUPER"}
    assert modes["25W"].min_jetpack == modes["MAXN_SUPER"].min_jetpack == "6.2"
    assert modes["15W"].min_jetpack is None
    assert modes["MAXN_SUPER"].watts is None  # uncapped
    # Faster modes draw more power; speed per watt falls as clocks (and voltage) rise.
    ordered = sorted(modes.values(), key=lambda m: m.relative_speed)
    assert [m.train_power_w for m in ordered] == sorted(m.train_power_w for m in ordered)


def test_plant_overshoots_the_board_throttle_in_its_enclosure() -> None:
    """The Orin Nano plant: constant full load in 15W mode in the 35 C enclosure settles over
    the 99 C throttle; a duty of 0.6 settles under the 85 C target."""
    p = load_profile("jetson-orin-nano-8gb")
    r, idle, load = p.plant.thermal_resistance_c_per_w, p.plant.idle_power_w, p.load_power_w()
    assert p.plant.ambient_c == 35.0
    assert p.plant.ambient_c + r * load > p.thermal.board_throttle_c
    assert p.plant.ambient_c + r * (idle + 0.6 * (load - idle)) < p.thermal.throttle_target_c


def _write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / f"{tree['name']}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _tree(name: str = "jetson-orin-nano-8gb") -> dict:
    from device_profiles import PROFILE_DIR

    tree = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    tree["name"] = "custom"
    return tree


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path) -> None:
    tree = _tree()
    tree["thermal"]["throtle_target_c"] = 80
    expected = r"thermal\.throtle_target_c: unknown key .*throttle_target_c"
    with pytest.raises(ProfileError, match=expected):
        load_profile_file(_write(tmp_path, tree))


def test_thermal_order_is_enforced(tmp_path: Path) -> None:
    tree = _tree()
    tree["thermal"]["soft_pause_c"] = 100.0
    expected = r"soft_pause_c \(100.0\) must be below board_throttle_c"
    with pytest.raises(ProfileError, match=expected):
        load_profile_file(_write(tmp_path, tree))


def test_plant_mode_must_exist(tmp_path: Path) -> None:
    tree = _tree()
    tree["plant"]["default_mode"] = "30W"
    with pytest.raises(ProfileError, match=r"plant\.default_mode: '30W' is not one of"):
        load_profile_file(_write(tmp_path, tree))


def test_budget_below_total(tmp_path: Path) -> None:
    tree = _tree()
    tree["memory"]["training_budget_mb"] = 9000
    with pytest.raises(ProfileError, match=r"training_budget_mb .* must be below total_mb"):
        load_profile_file(_write(tmp_path, tree))


def test_unknown_profile_suggests_the_closest() -> None:
    with pytest.raises(ProfileError, match="did you mean 'jetson-orin-nano-8gb'"):
        load_profile("jetson-orin-nano-8g")


def test_file_name_must_match(tmp_path: Path) -> None:
    tree = _tree()
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ProfileError, match="name must equal the file name 'other'"):
        load_profile_file(path)
