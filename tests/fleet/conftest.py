"""Fleet test set-up: a real mosquitto on a free port, simulated devices, a fleet db."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.mqtt import BrokerConfig
from fleet.sim import SimConfig, SimFleet
from tests.support.mosquitto import Broker


@pytest.fixture
def broker(mosquitto: Callable[..., Broker]) -> BrokerConfig:
    """The shared real mosquitto (tests/support/mosquitto.py), as the fleet's broker config."""
    b = mosquitto()
    return BrokerConfig(host=b.host, port=b.port)


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
