"""``agentctl sensors``: live readings; ``agentctl profiles``: the boards edgetrain knows."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from agent.sensors import BACKENDS, SensorUnavailable, open_backend
from agent.sensors.reading import Reading
from device_profiles import ProfileError, list_profiles, load_profile
from device_profiles.schema import DeviceProfile

SENSORS_EPILOG = """\
examples:
  agentctl sensors                          # 5 readings, first backend that works
  agentctl sensors --backend tegrastats --count 0 --interval 1   # until Ctrl-C
  agentctl sensors --backend sim --sim-time-scale 60 --json      # simulated board, JSON lines
  agentctl sensors --backend sim --state-dir runs/device         # the board its jobs heat

backends: jtop (jetson-stats service), tegrastats (JetPack tool), sysfs (thermal zones,
INA3221/hwmon, RAPL; no extra software), sim (the profile's thermal model: with --state-dir
that device's one simulated board, which its daemon and fine-tunes read and heat; without, a
board of this process's own, heated by its CPU use). auto tries the profile's list in order
and reports what it skipped.
"""

PROFILES_EPILOG = """\
The row marked * is the board detected here (from /proc/device-tree/model, compatible and
MemTotal). Power mode ids are read on the board at run time (nvpmodel -p --verbose); the
profiles list names and budgets only. Temperatures: target = governor setpoint, pause = soft
limit, throttle = the board's own throttle point.
"""


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def format_reading(r: Reading) -> str:
    hot = r.hottest()
    hottest = f"{hot[0]} {hot[1]:.1f}C" if hot else "-"
    power = _fmt(None if r.total_power_mw is None else r.total_power_mw / 1000, ".2f", "W")
    ram = (
        f"{r.ram_used_mb:.0f}/{r.ram_total_mb:.0f}MB"
        if r.ram_used_mb is not None and r.ram_total_mb is not None else "-"
    )
    rails = " ".join(f"{k}={v / 1000:.2f}W" for k, v in r.rails_mw.items())
    return (
        f"{time.strftime('%H:%M:%S')}  hottest {hottest:<14} power {power:<8} RAM {ram:<14} "
        f"GPU {_fmt(r.gpu_load_pct, '.0f', '%'):<5} mode {r.power_mode or '-':<10} {rails}"
    )


def _resolve_profile(name: str) -> DeviceProfile | None:
    if name == "auto":
        from device_profiles import detect_profile

        try:
            return detect_profile()
        except ProfileError:
            return None
    return load_profile(name)


def run_sensors(args: argparse.Namespace) -> int:
    try:
        profile = _resolve_profile(args.profile)
    except ProfileError as e:
        print(f"agentctl sensors: {e}", file=sys.stderr)
        return 2
    if args.backend == "sim" and (profile is None or args.profile == "auto"):
        # A simulated board, not a model of this machine; a device's board keeps its own.
        profile = None if args.state_dir else load_profile("sim")
    try:
        ctx = open_backend(args.backend, profile=profile, interval_s=args.interval,
                           sim_time_scale=args.sim_time_scale, state_dir=args.state_dir)
        with ctx as sensors:
            if not args.json:
                shown = getattr(getattr(sensors, "plant", None), "profile", profile)
                print(f"backend: {sensors.name}  profile: {shown.name if shown else '-'}")
            n = 0
            while args.count == 0 or n < args.count:
                if n:
                    time.sleep(args.interval)
                reading = sensors.read()
                if args.json:
                    print(json.dumps(reading.to_dict()), flush=True)
                else:
                    print(format_reading(reading), flush=True)
                n += 1
    except SensorUnavailable as e:
        print(f"agentctl sensors: backend {args.backend} unavailable: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def profile_row(p: DeviceProfile) -> dict[str, Any]:
    precision = "/".join(k for k in ("fp16", "bf16", "int8") if getattr(p.precision, k))
    return {
        "name": p.name,
        "family": p.family,
        "ram_gb": p.memory.total_mb / 1024,
        "budget_gb": p.memory.training_budget_mb / 1024,
        "modes": [m.name for m in p.power_modes],
        "target_c": p.thermal.throttle_target_c,
        "pause_c": p.thermal.soft_pause_c,
        "throttle_c": p.thermal.board_throttle_c,
        "critical_c": p.thermal.critical_c,
        "precision": precision,
        "sparsity_2_4": p.tensorrt.sparsity_2_4,
        "dla": p.tensorrt.dla_cores,
        "description": p.description,
    }


def run_profiles(args: argparse.Namespace) -> int:
    detected = None
    try:
        from device_profiles import detect_profile

        detected = detect_profile().name
    except ProfileError:
        pass
    rows = [profile_row(load_profile(n)) for n in list_profiles()]
    if args.json:
        print(json.dumps({"detected": detected, "profiles": rows}, indent=1))
        return 0
    header = (f"  {'NAME':<22} {'RAM':>5} {'BUDGET':>6}  {'TARGET/PAUSE/THROTTLE C':<23} "
              f"{'PRECISION':<14} {'2:4':<3} {'DLA':>3}  POWER MODES")
    print(header)
    for r in rows:
        mark = "*" if r["name"] == detected else " "
        temps = f"{r['target_c']:g}/{r['pause_c']:g}/{r['throttle_c']:g}"
        print(
            f"{mark} {r['name']:<22} {r['ram_gb']:>4.0f}G {r['budget_gb']:>5.1f}G  {temps:<23} "
            f"{r['precision']:<14} {'yes' if r['sparsity_2_4'] else 'no':<3} {r['dla']:>3}  "
            f"{', '.join(r['modes']) or '-'}"
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sensors",
        help="print live temperature, power and memory readings",
        description="Print live readings from one sensor backend: hottest zone, board power, "
        "RAM, GPU load and power mode, then every rail.",
        epilog=SENSORS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="sensor backend (default: auto)")
    p.add_argument("--profile", default="auto",
                   help="device profile for auto's backend order and the sim plant "
                   "(default: detect)")
    p.add_argument("--count", type=int, default=5, metavar="N",
                   help="readings to print; 0 = until Ctrl-C (default: 5)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between readings (default: 1)")
    p.add_argument("--json", action="store_true", help="one JSON object per reading")
    p.add_argument("--sim-time-scale", type=float, metavar="X",
                   help="sim only: simulated seconds per wall second (default: the device "
                   "board's, 1 for a new one)")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="sim only: read this device's simulated board, the one its daemon and "
                   "fine-tunes share (default: a board of this command's own)")
    p.set_defaults(func=run_sensors)

    q = subparsers.add_parser(
        "profiles",
        help="list the device profiles (boards) and mark the detected one",
        description="List every device profile: memory and training budget, thermal limits, "
        "precision, TensorRT features and power modes.",
        epilog=PROFILES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=run_profiles)
