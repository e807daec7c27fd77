"""tegrastats parsing on lines from eight boards and JetPack 3/4 through 7, and the backend
against a real child process that prints recorded lines."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from agent.sensors import SensorUnavailable, open_sensors
from agent.sensors.tegrastats import TegrastatsBackend, parse_line

DATA = Path(__file__).parent / "data"

# file: what the line says, written out by hand from the line itself.
CASES = {
    "jetson-nano_jp4.txt": dict(
        temps={"cpu": 60.5, "gpu": 59.0, "ao": 65.0, "pll": 57.0, "thermal": 59.75},
        hottest=("ao", 65.0),
        rails={"POM_5V_IN": 4520, "POM_5V_GPU": 0, "POM_5V_CPU": 1078},
        total=4520,  # the input rail, not input + GPU + CPU
        ram=(1180, 3965), swap=(149, 1024), gpu=(0.0, 76.0), cores=(30, 33, 28, 26),
    ),
    "jetson-nano_jp4_nonroot.txt": dict(
        temps={"cpu": 25.0, "gpu": 23.5, "ao": 33.5, "pll": 21.0, "thermal": 24.5},
        hottest=("ao", 33.5),
        rails={"POM_5V_IN": 2545, "POM_5V_CPU": 549},
        total=2545, ram=(1766, 3964), swap=(0, 2048), gpu=(0.0, None), cores=(24, 15, 13, 10),
    ),
    "jetson-nano_jp4_5w.txt": dict(
        temps={"cpu": 35.5, "gpu": 34.0, "ao": 41.5},
        hottest=("ao", 41.5),
        rails={"POM_5V_IN": 1084, "POM_5V_GPU": 19, "POM_5V_CPU": 163},
        total=1084, ram=(1465, 3956), swap=(0, 1978), gpu=(0.0, 76.0),
        cores=(12, 8, None, None),
    ),
    "jetson-tx2_jp3.txt": dict(
        temps={"bcpu": 41.0, "mcpu": 41.0, "gpu": 39.0, "tboard": 35.0, "tdiode": 37.75,
               "thermal": 40.2},
        hottest=("bcpu", 41.0),
        rails={"VDD_IN": 3177, "VDD_CPU": 536, "VDD_GPU": 383, "VDD_DDR": 575},
        total=3177, ram=(2586, 7846), swap=None, gpu=(53.0, 140.0), cores=(0, 0, 0, 0, 0, 0),
    ),
    "jetson-xavier-nx_jp4.txt": dict(
        temps={"cpu": 40.0, "gpu": 39.5, "aux": 38.5, "ao": 39.5, "thermal": 39.35},
        hottest=("cpu", 40.0),
        rails={"VDD_IN": 3884, "VDD_CPU_GPU_CV": 408, "VDD_SOC": 1225},
        total=3884, ram=(2862, 7772), swap=(0, 3886), gpu=(0.0, 306.0),
        cores=(2, 1, None, None, None, None),
    ),
    "jetson-agx-xavier_jp4.txt": dict(
        temps={"cpu": 39.0, "gpu": 38.5, "tdiode": 41.25, "tboard": 38.0},
        hottest=("tdiode", 41.25),
        # Rails without a VDD_ prefix and no input rail: the total is their sum.
        rails={"GPU": 0, "CPU": 155, "SOC": 1243, "CV": 0, "VDDRQ": 310, "SYS5V": 1849},
        total=155 + 1243 + 310 + 1849, ram=(2255, 31919), swap=(0, 15959), gpu=(0.0, 1377.0),
        cores=(1, 0, 0, 0, None, None, None, None),
    ),
    "jetson-agx-orin-64gb_jp5_gr3d2.txt": dict(
        temps={"cpu": 42.593, "tj": 42.593, "soc0": 39.375, "soc1": 40.468, "soc2": 39.343,
               "tboard": 32.0, "tdiode": 33.25},
        offline=("gpu", "cv0", "cv1", "cv2"),  # -256C: power-gated
        hottest=("cpu", 42.593),
        rails={"VDD_GPU_SOC": 2399, "VDD_CPU_CV": 400, "VIN_SYS_5V0": 4032,
               "VDDQ_VDD2_1V8AO": 301},
        total=2399 + 400 + 4032 + 301,  # AGX Orin: no input rail, NC channels skipped
        ram=(1282, 62795), swap=(0, 31398), gpu=(0.0, 0.0), cores=(0,) * 12,
    ),
    "jetson-agx-orin-64gb_jp5.1.txt": dict(
        temps={"cpu": 44.562, "tj": 44.343, "soc0": 41.093},
        offline=("gpu", "cv0", "cv1", "cv2"),
        hottest=("cpu", 44.562),
        rails={"VDD_GPU_SOC": 2340, "VDD_CPU_CV": 390, "VIN_SYS_5V0": 4025},
        total=2340 + 390 + 4025 + 301, ram=(4321, 62801), swap=(19, 31400), gpu=(0.0, 0.0),
        cores=(0,) * 12,
    ),
    "jetson-agx-orin-64gb_jp6.txt": dict(
        temps={"cpu": 52.562, "tj": 52.562, "soc0": 49.093, "soc1": 49.656, "soc2": 48.437},
        hottest=("cpu", 52.562),
        rails={"VDD_GPU_SOC": 2412, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4707},
        total=2412 + 1607 + 4707, ram=(18207, 62841), swap=(86, 31420), gpu=(0.0, 0.0),
        cores=(14, 5, 8, 14, 46, 47, 2, 10, 4, 5, 6, 10),
    ),
    "jetson-orin-nano-8gb_jp6.txt": dict(
        temps={"cpu": 53.968, "gpu": 53.343, "tj": 53.968, "soc0": 50.75, "soc2": 52.437},
        hottest=("cpu", 53.968),
        rails={"VDD_IN": 12479, "VDD_CPU_GPU_CV": 4667, "VDD_SOC": 2817},
        total=12479, ram=(6185, 7620), swap=(851, 3810), gpu=(63.0, 621.0),
        cores=(15, 11, 14, 13, 11, 8),
    ),
    "jetson-orin-nx-8gb_jp6.txt": dict(
        temps={"cv0": 63.031, "cpu": 65.562, "gpu": 63.5, "tj": 65.562, "cv2": 60.875},
        hottest=("cpu", 65.562),
        rails={"VDD_IN": 17946, "VDD_CPU_GPU_CV": 8896, "VDD_SOC": 3923},
        total=17946, ram=(6982, 7620), swap=(2640, 16384), gpu=(84.0, 713.0),
        cores=(97, 95, 95, 91, 88, 93),
    ),
    "jetson-agx-thor_jp7.txt": dict(
        # current/max pairs: the current value counts; no GR3D field on JetPack 7.
        temps={"cpu": 52.906, "tj": 52.906, "soc012": 50.593, "soc345": 51.218},
        hottest=("cpu", 52.906),
        rails={"VDD_GPU": 0, "VDD_CPU_SOC_MSS": 6513, "VIN_SYS_5V0": 6521, "VIN": 23041},
        total=23041, ram=(9517, 125772), swap=(0, 0), gpu=(None, None),
        cores=(3, 1, 0, 2, 0, 1, 0, 0, 4, 0, 1, 0, 0, None),
    ),
}


def _line(name: str) -> str:
    return (DATA / name).read_text().splitlines()[0]


def test_every_data_file_has_a_case() -> None:
    files = {p.name for p in DATA.glob("*.txt")}
    assert files == set(CASES)
    # Boards x releases covered: at least 6 distinct (board, JetPack) pairs.
    assert len({name.rsplit("_", 1)[0] for name in files}) >= 7


@pytest.mark.parametrize("name", sorted(CASES))
def test_parse_recorded_line(name: str) -> None:
    case = CASES[name]
    r = parse_line(_line(name), timestamp_s=123.0)
    assert r.source == "tegrastats"
    assert r.timestamp_s == 123.0
    for zone, value in case["temps"].items():
        assert r.temps_c[zone] == pytest.approx(value), zone
    for zone in case.get("offline", ()):
        assert zone not in r.temps_c, f"{zone} reads -256C (offline) and must be dropped"
    assert r.hottest() == (case["hottest"][0], pytest.approx(case["hottest"][1]))
    for rail, mw in case["rails"].items():
        assert r.rails_mw[rail] == pytest.approx(mw), rail
    assert "NC" not in r.rails_mw
    assert r.total_power_mw == pytest.approx(case["total"])
    assert (r.ram_used_mb, r.ram_total_mb) == case["ram"]
    if case["swap"] is None:
        assert r.swap_total_mb is None
    else:
        assert (r.swap_used_mb, r.swap_total_mb) == case["swap"]
    assert (r.gpu_load_pct, r.gpu_freq_mhz) == case["gpu"]
    assert r.cpu_load_pct == tuple(None if c is None else float(c) for c in case["cores"])


def test_pmic_placeholder_is_never_the_hottest_zone() -> None:
    r = parse_line(_line("jetson-nano_jp4.txt"))
    assert r.temps_c["pmic"] == 100.0  # kept as read...
    assert r.hottest()[0] != "pmic"  # ...but not a die temperature


def test_control_zones_restrict_the_hottest() -> None:
    r = parse_line(_line("jetson-orin-nx-8gb_jp6.txt"))
    assert r.hottest(["gpu", "cv0"]) == ("gpu", 63.5)
    assert r.hottest(["nonexistent"]) == ("cpu", 65.562)  # falls back to all die zones


def test_two_value_rails_and_units_are_equivalent() -> None:
    old = parse_line("RAM 1/2MB VDD_IN 5251/8535 VDD_SOC 100/90")
    new = parse_line("RAM 1/2MB VDD_IN 5251mW/8535mW VDD_SOC 100mW/90mW")
    assert old.rails_mw == new.rails_mw == {"VDD_IN": 5251.0, "VDD_SOC": 100.0}


def test_old_cpu_format_and_unknown_fields() -> None:
    r = parse_line(
        "RAM 3468/3983MB (lfb 48x4MB) SWAP 873/8192MB (cached 295MB) "
        "cpu [17%,13%,29%,5%]@408 EMC 1%@408 APE 25 GR3D 3%@76 FUTURE_FIELD 7@[1,2]"
    )
    assert r.cpu_load_pct == (17.0, 13.0, 29.0, 5.0)
    assert (r.gpu_load_pct, r.gpu_freq_mhz) == (3.0, 76.0)
    assert r.temps_c == {} and r.rails_mw == {} and r.total_power_mw is None


def test_garbage_gives_an_empty_reading_not_an_exception() -> None:
    r = parse_line("tegrastats: permission denied \x00\xff")
    assert r.temps_c == {} and r.ram_total_mb is None and r.hottest() is None


def _fake_tegrastats(bin_dir: Path, lines: list[str], then_exit: bool) -> None:
    """A stand-in `tegrastats` executable: prints recorded lines at the requested interval."""
    body = "\n".join(f"echo '{line}'; sleep 0.05" for line in lines)
    tail = "exit 3" if then_exit else "while true; do sleep 0.05; done"
    script = bin_dir / "tegrastats"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = --interval ] || exit 9\n{body}\n{tail}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_backend_reads_latest_line_from_the_process(tmp_path, monkeypatch) -> None:
    lines = [_line("jetson-orin-nano-8gb_jp6.txt"), _line("jetson-orin-nx-8gb_jp6.txt")]
    _fake_tegrastats(tmp_path, lines, then_exit=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    backend = TegrastatsBackend(interval_ms=50)
    try:
        deadline = time.monotonic() + 5
        while backend.read().total_power_mw != 17946 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backend.read().total_power_mw == 17946  # the newest line wins
    finally:
        backend.close()


def test_backend_degrades_once_when_tegrastats_dies(tmp_path, monkeypatch, caplog) -> None:
    _fake_tegrastats(tmp_path, [_line("jetson-orin-nano-8gb_jp6.txt")], then_exit=True)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    backend = TegrastatsBackend(interval_ms=50)
    try:
        deadline = time.monotonic() + 5
        while backend._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with caplog.at_level(logging.WARNING, logger="agent.sensors"):
            readings = [backend.read() for _ in range(5)]
        assert all(r.temps_c == {} for r in readings)
        assert len([m for m in caplog.messages if "exited" in m]) == 1
    finally:
        backend.close()


def test_missing_tegrastats_is_unavailable_and_auto_moves_on(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    with pytest.raises(SensorUnavailable, match="not found"):
        TegrastatsBackend()
    # auto with an empty sysfs root: every backend fails -> empty readings, no exception.
    sensors = open_sensors("auto", root=tmp_path)
    assert sensors.name == "none" and sensors.read().temps_c == {}
