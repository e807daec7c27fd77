"""Fleet test set-up: a real mosquitto on a free port, simulated devices, a fleet db."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.mqtt import BrokerConfig
from fleet.sim import SimConfig, SimFleet


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerConfig]:
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    port = _free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        "set_tcp_nodelay true\nmax_queued_messages 100000\n"
    )
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("mosquitto did not start") from None
            time.sleep(0.05)
    yield BrokerConfig(port=port)
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def sim_fleet(broker: BrokerConfig) -> Iterator[Callable[..., SimFleet]]:
    """Start simulated devices in this process (their state is inspectable); stopped after."""
    started: list[SimFleet] = []

    def start(**cfg: Any) -> SimFleet:
        fleet = SimFleet(SimConfig.model_validate(cfg), broker).start()
        started.append(fleet)
        return fleet

    yield start
    for f in started:
        f.stop()
        assert not f.errors, f.errors


@pytest.fixture
def fleetctl(
    broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str]
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real ``fleetctl`` in a subprocess against the test broker and a test db."""

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            fleetctl_argv(broker, tmp_path) + list(args), capture_output=True, text=True,
            timeout=timeout, env=subprocess_env,
        )

    return run


def fleetctl_argv(broker: BrokerConfig, tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "fleet.cli", "--port", str(broker.port),
            "--db", str(tmp_path / "fleet.db"), "--report-dir", str(tmp_path / "reports"),
            "--settle-s", "0.3"]
