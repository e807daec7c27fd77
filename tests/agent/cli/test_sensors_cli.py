"""agentctl sensors / profiles, run as a user would (subprocess through agent.cli)."""

from __future__ import annotations

import json
import subprocess
import sys

from device_profiles import list_profiles


def agentctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_sensors_sim_json(subprocess_env: dict[str, str]) -> None:
    out = agentctl("sensors", "--backend", "sim", "--count", "3", "--interval", "0.05", "--json",
                   env=subprocess_env)
    assert out.returncode == 0, out.stderr
    readings = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(readings) == 3
    assert all(r["source"] == "sim" and r["temps_c"]["tj"] > 35.0 for r in readings)
    assert readings[0]["power_mode"] == "15W"  # the sim profile's start mode


def test_sensors_table_and_unavailable_backend(subprocess_env: dict[str, str]) -> None:
    out = agentctl("sensors", "--backend", "sim", "--count", "1", env=subprocess_env)
    assert out.returncode == 0 and "backend: sim" in out.stdout and "hottest tj" in out.stdout
    out = agentctl("sensors", "--backend", "jtop", "--count", "1", env=subprocess_env)
    assert out.returncode == 1 and "jtop unavailable" in out.stderr


def test_profiles(subprocess_env: dict[str, str]) -> None:
    out = agentctl("profiles", "--json", env=subprocess_env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [p["name"] for p in data["profiles"]] == list_profiles()
    nano = next(p for p in data["profiles"] if p["name"] == "jetson-orin-nano-8gb")
    assert nano["throttle_c"] == 99.0 and "MAXN_SUPER" in nano["modes"]
    table = agentctl("profiles", env=subprocess_env).stdout
    assert "jetson-agx-orin-64gb" in table and "85/95/99" in table
    helptext = agentctl("sensors", "--help", env=subprocess_env).stdout
    assert "examples:" in helptext and "--backend" in helptext
