"""nvpmodel output parsing on recorded output, and mode ids resolved per board."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from device_profiles import load_profile
from device_profiles.nvpmodel import (
    JtopSetter,
    NvpMode,
    NvpmodelError,
    NvpmodelSetter,
    NvpmodelSwitcher,
    mode_setter,
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


# -- switching without root: the jetson-stats service ------------------------------------------


class _FakeJetson:
    """What ``jtop()`` yields, as far as the power mode goes: setting ``nvpmodel`` asks the
    root service, which may refuse (a client outside the jtop group)."""

    board_mode = 0
    allowed = True

    def __enter__(self) -> _FakeJetson:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def ok(self) -> bool:
        return True

    @property
    def nvpmodel(self) -> int:
        return type(self).board_mode

    @nvpmodel.setter
    def nvpmodel(self, mode_id: int) -> None:
        if not type(self).allowed:
            raise PermissionError("jtop: permission denied")
        type(self).board_mode = mode_id


def test_jtop_setter_switches_through_the_service_and_reports_a_refusal() -> None:
    setter = JtopSetter(connect=_FakeJetson)
    setter.set(3)
    assert _FakeJetson.board_mode == 3
    _FakeJetson.allowed = False
    try:
        with pytest.raises(PermissionError):
            setter.set(1)
    finally:
        _FakeJetson.allowed = True
    assert _FakeJetson.board_mode == 3
    sw = NvpmodelSwitcher(load_profile("jetson-orin-nano-8gb"), lambda argv: (
        "NV Power Mode: 15W\n0\n" if argv[1] == "-q"
        else (DATA / "nvpmodel_orin_nano_super_p.txt").read_text()), setter=setter)
    sw.switch("25W")
    assert _FakeJetson.board_mode == 1 and sw.current() == "25W"


def test_mode_setter_picks_root_then_jtop_and_says_why_neither(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from device_profiles import nvpmodel

    monkeypatch.setattr(nvpmodel, "available", lambda: False)
    setter, why = mode_setter(euid=0)
    assert setter is None and "no nvpmodel" in why
    monkeypatch.setattr(nvpmodel, "available", lambda: True)
    setter, why = mode_setter(euid=0)
    assert isinstance(setter, NvpmodelSetter) and "root" in why
    # Not root, no jetson-stats.
    monkeypatch.setitem(sys.modules, "jtop", None)
    setter, why = mode_setter(euid=1000, socket=tmp_path / "jtop.sock")
    assert setter is None and "jetson-stats is not installed" in why
    fake = types.ModuleType("jtop")
    fake.jtop = _FakeJetson  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jtop", fake)
    setter, why = mode_setter(euid=1000, socket=tmp_path / "jtop.sock")
    assert setter is None and "not running" in why and "systemctl enable --now jtop" in why
    sock = tmp_path / "jtop.sock"
    sock.touch(mode=0o600)
    if os.geteuid() != 0:  # root may use any file: the group check cannot show here
        sock.chmod(0o000)
        setter, why = mode_setter(euid=1000, socket=sock)
        assert setter is None and "jtop group" in why
        sock.chmod(0o600)
    setter, why = mode_setter(euid=1000, socket=sock)
    assert isinstance(setter, JtopSetter) and str(sock) in why
