"""Config (extra=forbid, EDGE_AGENT_* overrides, ``edge-agent validate``) and the systemd unit
(``systemd-analyze verify`` clean, hardening exposure <= 2.5)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.daemon.config import ConfigError, load_agent_config

REPO = Path(__file__).resolve().parents[3]
UNIT = REPO / "systemd" / "edge-agent.service"


def test_env_overrides_and_unknown_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("device_id: dev-1\nmqtt: {host: a}\n")
    c = load_agent_config(cfg, {"EDGE_AGENT_MQTT__PORT": "8883",
                                "EDGE_AGENT_GROUPS": "[lab, b]"})
    assert (c.mqtt.host, c.mqtt.port, c.groups) == ("a", 8883, ["lab", "b"])
    with pytest.raises(ConfigError, match=r"mqtt\.hots: unknown key \(did you mean 'host'"):
        load_agent_config(cfg, {"EDGE_AGENT_MQTT__HOTS": "x"})
    cfg.write_text("device_id: 'bad/id'\n")
    with pytest.raises(ConfigError, match="device_id"):
        load_agent_config(cfg, {})
    # A control socket past sun_path's 107 bytes is a config error naming the fix, not a
    # daemon that fails to bind at start.
    deep = "/var/lib/" + "x" * 100
    cfg.write_text(f"device_id: dev-1\nstate_dir: {deep}\n")
    with pytest.raises(ConfigError, match=r"state_dir: the control socket .* set control_socket"):
        load_agent_config(cfg, {})
    cfg.write_text(f"device_id: dev-1\nstate_dir: {deep}\ncontrol_socket: /run/ea/agent.sock\n")
    assert load_agent_config(cfg, {}).socket_path == Path("/run/ea/agent.sock")


def test_validate_cli(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("device_id: dev-1\ntelemetry_s: -1\n")
    run = [sys.executable, "-m", "agent.daemon", "validate", str(cfg)]
    bad = subprocess.run(run, capture_output=True, text=True, env=subprocess_env)
    assert bad.returncode == 2 and "telemetry_s" in bad.stderr
    cfg.write_text("device_id: dev-1\n")
    ok = subprocess.run(run, capture_output=True, text=True, env=subprocess_env)
    assert ok.returncode == 0 and "device_id: dev-1" in ok.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="apt-get install systemd")
def test_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    # The unit runs /usr/local/bin/edge-agent (install.sh links it); verify needs the binary
    # to exist, so check a copy pointing at this checkout's console script.
    exe = Path(sys.executable).parent / "edge-agent"
    if not exe.exists():
        pytest.skip("edge-agent console script not installed (pip install -e .)")
    unit = tmp_path / "edge-agent.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/edge-agent", str(exe)))
    v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert v.returncode == 0 and not v.stderr.strip(), v.stderr
    s = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)],
                       capture_output=True, text=True)
    level = float(re.search(r"exposure level for edge-agent.service: ([\d.]+)", s.stdout)[1])
    assert level <= 2.5, s.stdout[-2000:]
