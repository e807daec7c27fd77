"""jtop (jetson-stats) backend: parsing of a recorded ``jetson.stats`` dict; the live path
needs the jtop service and skips elsewhere."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from agent.sensors.jtop import parse_stats

# jetson.stats of jetson-stats 4.2 on an Orin Nano 8GB dev kit (JetPack 6), training on the GPU.
RECORDED = {
    "time": datetime(2024, 11, 15, 8, 38, 9),
    "uptime": timedelta(hours=3, minutes=12),
    "CPU1": 15, "CPU2": 11, "CPU3": 14, "CPU4": 13, "CPU5": "OFF", "CPU6": "OFF",
    "RAM": 0.8117,
    "SWAP": 0.2234,
    "EMC": 43,
    "GPU": 63.0,
    "APE": "OFF", "NVDEC": "OFF", "NVJPG": "OFF", "NVJPG1": "OFF", "OFA": "OFF", "SE": "OFF",
    "VIC": "OFF",
    "Fan pwmfan0": 33.7,
    "Temp cpu": 53.968,
    "Temp cv0": -256.0,
    "Temp cv1": -256.0,
    "Temp gpu": 53.343,
    "Temp soc0": 50.75,
    "Temp soc1": 51.656,
    "Temp soc2": 52.437,
    "Temp tj": 53.968,
    "Power VDD_CPU_GPU_CV": 4667,
    "Power VDD_SOC": 2817,
    "Power TOT": 12479,
    "jetson_clocks": "OFF",
    "nvp model": "15W",
}


def test_parse_recorded_stats() -> None:
    r = parse_stats(RECORDED, ram_total_mb=7620.0, swap_total_mb=3810.0, nvmap_used_mb=2100.0)
    assert r.source == "jtop"
    assert r.timestamp_s == datetime(2024, 11, 15, 8, 38, 9).timestamp()
    assert r.temps_c == pytest.approx({"cpu": 53.968, "gpu": 53.343, "soc0": 50.75,
                                       "soc1": 51.656, "soc2": 52.437, "tj": 53.968})
    assert "cv0" not in r.temps_c  # -256 = offline
    assert r.hottest() == ("cpu", 53.968)
    assert r.rails_mw == {"VDD_CPU_GPU_CV": 4667.0, "VDD_SOC": 2817.0}
    assert r.total_power_mw == 12479.0  # jtop's own total (VDD_IN), not the rail sum
    assert r.power_mode == "15W"  # the literal key 'nvp model'
    assert r.ram_used_mb == pytest.approx(0.8117 * 7620)
    assert r.swap_used_mb == pytest.approx(0.2234 * 3810)
    assert r.nvmap_used_mb == 2100.0
    assert r.gpu_load_pct == 63.0
    assert r.cpu_load_pct == (15.0, 11.0, 14.0, 13.0, None, None)


def test_missing_fields_stay_none() -> None:
    r = parse_stats({"Temp CPU": 40.5, "Power VDD_GPU_SOC": 2399, "Power VDD_CPU_CV": 400})
    assert r.temps_c == {"cpu": 40.5}
    assert r.total_power_mw == 2799.0  # no 'Power TOT': summed like AGX Orin rails
    assert r.ram_used_mb is None and r.power_mode is None and r.gpu_load_pct is None


def test_live_jtop() -> None:
    pytest.importorskip("jtop", reason="jetson-stats is not installed (Jetson only)")
    from agent.sensors import SensorUnavailable
    from agent.sensors.jtop import JtopBackend

    try:
        backend = JtopBackend()
    except SensorUnavailable as e:
        pytest.skip(f"jtop service not reachable: {e}")
    try:
        r = backend.read()
        assert r.temps_c, "a running jtop service reports temperatures"
    finally:
        backend.close()
