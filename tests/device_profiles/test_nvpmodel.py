"""nvpmodel output parsing on recorded output, and mode ids resolved per board."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from device_profiles import load_profile
from device_profiles.nvpmodel import (
    NvpMode,
    NvpmodelError,
    NvpmodelSwitcher,
    parse_modes,
    parse_query,
    read_active,
    read_modes,
    run_command,
    set_mode,
    usable_modes,
)

DATA = Path(__file__).parent / "data"


def test_orin_nano_super_ids() -> None:
    info = parse_modes((DATA / "nvpmodel_orin_nano_super_p.txt").read_text())
    assert [(m.id, m.name) for m in info.modes] == [
        (0, "15W"), (1, "25W"), (2, "MAXN_SUPER"), (3, "7W")]
    assert info.default == NvpMode(1, "25W")
    # The profile lists names; the ids come from the board.
    ids = usable_modes(load_profile("jetson-orin-nano-8gb"), info)
    assert ids == {"15W": 0, "7W": 3, "25W": 1, "MAXN_SUPER": 2}


def test_nano_and_xavier_nx() -> None:
    nano = parse_modes((DATA / "nvpmodel_nano_p.txt").read_text())
    assert [(m.id, m.name) for m in nano.modes] == [(0, "MAXN"), (1, "5W")]
    assert nano.default == NvpMode(0, "MAXN")
    nx = parse_modes((DATA / "nvpmodel_xavier_nx_p.txt").read_text())
    assert len(nx.modes) == 9 and nx.id_of("MODE_20W_6CORE") == 8
    # MODE_10W_DESKTOP is not a training mode, so the profile does not list it.
    assert "MODE_10W_DESKTOP" not in usable_modes(load_profile("jetson-xavier-nx"), nx)


def test_conf_file_syntax_parses_too() -> None:
    info = parse_modes("< POWER_MODEL ID=0 NAME=15W >\n< POWER_MODEL ID=1 NAME=7W >\n")
    assert [m.name for m in info.modes] == ["15W", "7W"] and info.default is None


def test_older_release_without_super_modes() -> None:
    info = parse_modes(
        "NVPM VERB: POWER_MODEL: ID=0 NAME=15W\nNVPM VERB: POWER_MODEL: ID=1 NAME=7W"
    )
    assert usable_modes(load_profile("jetson-orin-nano-8gb"), info) == {"15W": 0, "7W": 1}


def test_query() -> None:
    text = "NVPM WARN: fan mode is not set!\nNV Power Mode: MAXN_SUPER\n2\n"
    assert parse_query(text) == NvpMode(2, "MAXN_SUPER")
    assert parse_query("nothing here") is None


def test_commands_go_through_the_runner() -> None:
    calls: list[list[str]] = []

    def runner(argv: Sequence[str]) -> str:
        calls.append(list(argv))
        if argv[1] == "-q":
            return "NV Power Mode: 15W\n0\n"
        if argv[1] == "-p":
            return (DATA / "nvpmodel_orin_nano_super_p.txt").read_text()
        return ""

    assert read_modes(runner).id_of("MAXN_SUPER") == 2
    assert read_active(runner) == NvpMode(0, "15W")
    set_mode(2, runner)
    assert calls[-1] == ["nvpmodel", "-m", "2"]


def test_switcher_uses_the_board_ids() -> None:
    calls: list[list[str]] = []

    def runner(argv: Sequence[str]) -> str:
        calls.append(list(argv))
        if argv[1] == "-q":
            return "NV Power Mode: 15W\n0\n"
        if argv[1] == "-p":
            return (DATA / "nvpmodel_orin_nano_super_p.txt").read_text()
        return ""

    sw = NvpmodelSwitcher(load_profile("jetson-orin-nano-8gb"), runner)
    assert sw.current() == "15W"
    assert sorted(sw.available()) == ["15W", "25W", "7W", "MAXN_SUPER"]
    sw.switch("7W")
    assert calls[-1] == ["nvpmodel", "-m", "3"] and sw.current() == "7W"
    with pytest.raises(NvpmodelError, match="not available"):
        sw.switch("MAXN")


def test_run_command_reports_failures() -> None:
    with pytest.raises(NvpmodelError, match="exit 3"):
        run_command(["sh", "-c", "echo 'NVPM ERROR: bad mode' >&2; exit 3"])
    with pytest.raises(NvpmodelError, match="NVPM ERROR"):
        run_command(["sh", "-c", "echo 'NVPM ERROR: Error opening /sys/...'"])
