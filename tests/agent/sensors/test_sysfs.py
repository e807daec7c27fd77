"""The sysfs backend on fake kernel trees built in tmp_path: Orin Nano (INA3221 with a total
rail), AGX Orin (no total rail, NC channels), JetPack 4 iio rails, and x86 (hwmon + RAPL)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.sensors import SensorUnavailable
from agent.sensors.sysfs import SysfsBackend

MEMINFO = """MemTotal:        7802720 kB
MemFree:          301532 kB
MemAvailable:    1543372 kB
SwapTotal:       3901344 kB
SwapFree:        3030000 kB
NvMapMemUsed:    2097152 kB
"""


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def zone(root: Path, n: int, kind: str, millic: int | str) -> None:
    write(root, f"sys/class/thermal/thermal_zone{n}/type", kind)
    write(root, f"sys/class/thermal/thermal_zone{n}/temp", str(millic))


def ina3221(root: Path, n: int, rails: list[tuple[str, int, int]]) -> None:
    """rails: (label, millivolts, milliamps) per channel, hwmon layout of JetPack 5/6."""
    write(root, f"sys/class/hwmon/hwmon{n}/name", "ina3221")
    for i, (label, mv, ma) in enumerate(rails, start=1):
        write(root, f"sys/class/hwmon/hwmon{n}/in{i}_label", label)
        write(root, f"sys/class/hwmon/hwmon{n}/in{i}_input", str(mv))
        write(root, f"sys/class/hwmon/hwmon{n}/curr{i}_input", str(ma))


def orin_nano_tree(root: Path) -> None:
    # Zone numbering deliberately shuffled: lookups go by type.
    zone(root, 0, "cpu-thermal", 53968)
    zone(root, 1, "gpu-thermal", 53343)
    zone(root, 3, "soc0-thermal", 50750)
    zone(root, 5, "tj-thermal", 54125)
    zone(root, 7, "cv0-thermal", -256000)  # power-gated
    ina3221(root, 1, [("VDD_IN", 5000, 2496), ("VDD_CPU_GPU_CV", 5000, 933),
                      ("VDD_SOC", 5000, 563)])
    write(root, "proc/meminfo", MEMINFO)
    write(root, "sys/devices/platform/gpu.0/load", "634")
    write(root, "var/lib/nvpmodel/status", "pmode:0002 fmode:quiet")
    write(root, "etc/nvpmodel.conf",
          "< POWER_MODEL ID=0 NAME=15W >\n< POWER_MODEL ID=1 NAME=25W >\n"
          "< POWER_MODEL ID=2 NAME=MAXN_SUPER >\n< POWER_MODEL ID=3 NAME=7W >")


def test_orin_nano_tree(tmp_path: Path) -> None:
    orin_nano_tree(tmp_path)
    r = SysfsBackend(root=tmp_path, clock=lambda: 50.0).read()
    assert r.timestamp_s == 50.0
    assert r.temps_c == pytest.approx({"cpu": 53.968, "gpu": 53.343, "soc0": 50.75, "tj": 54.125})
    assert r.hottest() == ("tj", 54.125)
    assert r.rails_mw == pytest.approx({"VDD_IN": 12480.0, "VDD_CPU_GPU_CV": 4665.0,
                                        "VDD_SOC": 2815.0})
    # VDD_IN is the board input: never add the rails it feeds on top of it.
    assert r.total_power_mw == pytest.approx(12480.0)
    assert r.ram_total_mb == pytest.approx(7802720 / 1024)
    assert r.ram_used_mb == pytest.approx((7802720 - 1543372) / 1024)
    assert r.swap_used_mb == pytest.approx((3901344 - 3030000) / 1024)
    assert r.nvmap_used_mb == pytest.approx(2048.0)
    assert r.gpu_load_pct == pytest.approx(63.4)
    assert r.power_mode == "MAXN_SUPER"  # id 2 on this board's conf, read at run time


def test_agx_orin_sums_rails_and_skips_nc(tmp_path: Path) -> None:
    zone(tmp_path, 0, "tj-thermal", 44343)
    ina3221(tmp_path, 0, [("VDD_GPU_SOC", 5000, 480), ("VDD_CPU_CV", 5000, 78),
                          ("VIN_SYS_5V0", 5000, 805)])
    ina3221(tmp_path, 1, [("NC", 0, 0), ("VDDQ_VDD2_1V8AO", 5000, 60), ("NC", 0, 0)])
    r = SysfsBackend(root=tmp_path).read()
    assert set(r.rails_mw) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert r.total_power_mw == pytest.approx((480 + 78 + 805 + 60) * 5.0)


def test_jetpack4_iio_rails(tmp_path: Path) -> None:
    dev = "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    for i, (name, mw) in enumerate([("POM_5V_IN", 4520), ("POM_5V_GPU", 0), ("POM_5V_CPU", 1078)]):
        write(tmp_path, f"{dev}/rail_name_{i}", name)
        write(tmp_path, f"{dev}/in_power{i}_input", str(mw))
    zone(tmp_path, 0, "CPU-therm", 60500)
    zone(tmp_path, 1, "PMIC-Die", 100000)
    zone(tmp_path, 2, "thermal-fan-est", 59750)
    write(tmp_path, "sys/devices/gpu.0/load", "0")
    r = SysfsBackend(root=tmp_path).read()
    assert r.total_power_mw == 4520.0
    assert r.temps_c == {"cpu": 60.5, "pmic": 100.0, "thermal": 59.75}
    assert r.hottest() == ("cpu", 60.5)  # the PMIC placeholder is ignored
    assert r.gpu_load_pct == 0.0


def test_x86_hwmon_and_rapl_with_wraparound(tmp_path: Path) -> None:
    write(tmp_path, "sys/class/hwmon/hwmon2/name", "coretemp")
    write(tmp_path, "sys/class/hwmon/hwmon2/temp1_label", "Package id 0")
    write(tmp_path, "sys/class/hwmon/hwmon2/temp1_input", "61000")
    zone(tmp_path, 0, "x86_pkg_temp", 61000)
    rapl = "sys/class/powercap/intel-rapl:0"
    write(tmp_path, f"{rapl}/name", "package-0")
    write(tmp_path, f"{rapl}/max_energy_range_uj", "262143328850")
    write(tmp_path, f"{rapl}/energy_uj", "262143000000")
    write(tmp_path, "sys/class/powercap/intel-rapl:0:0/name", "core")  # sub-zone: not counted
    times = iter([10.0, 12.0, 14.0])
    backend = SysfsBackend(root=tmp_path, clock=lambda: next(times))
    first = backend.read()
    assert first.total_power_mw is None  # energy needs two reads
    assert first.temps_c["x86_pkg_temp"] == 61.0
    assert first.temps_c["coretemp_package_id_0"] == 61.0
    # 2 s later the counter wrapped: (max - prev) + new = 328850 + 89671150 uJ = 90 J -> 45 W.
    write(tmp_path, f"{rapl}/energy_uj", "89671150")
    second = backend.read()
    assert second.rails_mw == pytest.approx({"RAPL_PACKAGE_0": 45000.0})
    assert second.total_power_mw == pytest.approx(45000.0)


def test_unreadable_files_are_reported_once_and_skipped(tmp_path: Path, caplog) -> None:
    orin_nano_tree(tmp_path)
    # A power-gated GPU zone fails to read on Orin; here: garbage in the file.
    write(tmp_path, "sys/class/thermal/thermal_zone1/temp", "EAGAIN")
    backend = SysfsBackend(root=tmp_path)
    with caplog.at_level(logging.WARNING, logger="agent.sensors"):
        readings = [backend.read() for _ in range(3)]
    assert all("gpu" not in r.temps_c and r.temps_c["tj"] == 54.125 for r in readings)
    assert len([m for m in caplog.messages if "thermal_zone1" in m]) == 1


def test_empty_root_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(SensorUnavailable, match="no thermal zones"):
        SysfsBackend(root=tmp_path)
