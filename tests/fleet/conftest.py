"""Fleet test set-up: a real mosquitto on a free port, simulated devices, a fleet db."""

from __future__ import annotations

import importlib.util
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.mqtt import BrokerConfig
from fleet.sim.config import SimConfig
from fleet.sim.fleet import SimFleet
from tests.support.mosquitto import Broker
from tests.support.registry_fixtures import upstream_key  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def broker(mosquitto: Callable[..., Broker]) -> BrokerConfig:
    """The shared real mosquitto (tests/support/mosquitto.py), as the fleet's broker config."""
    b = mosquitto()
    return BrokerConfig(host=b.host, port=b.port, username=b.username,
                        password_file=b.password_file)


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
def fleet_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The controller's db: a SQLite file, or with ``@pytest.mark.parametrize("fleet_db",
    ["sqlite", "postgresql"], indirect=True)`` a fresh database on a real PostgreSQL."""
    engine = getattr(request, "param", "sqlite")
    if engine == "postgresql":
        return str(request.getfixturevalue("postgres_url"))
    assert engine == "sqlite", engine
    return str(tmp_path / "fleet.db")


BOTH_ENGINES = pytest.mark.parametrize("fleet_db", ["sqlite", "postgresql"], indirect=True)
"""A test that runs on SQLite and on PostgreSQL (the store's two engines)."""


@pytest.fixture
def fleetctl(
    broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str], fleet_db: str
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real ``fleetctl`` in a subprocess against the test broker and a test db."""

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            fleetctl_argv(broker, tmp_path, fleet_db) + list(args), capture_output=True,
            text=True, timeout=timeout, env=subprocess_env,
        )

    return run


def fleetctl_argv(broker: BrokerConfig, tmp_path: Path, db: str | None = None) -> list[str]:
    creds = ([] if broker.username is None else
             ["--username", broker.username, "--password-file", str(broker.password_file)])
    return [sys.executable, "-m", "fleet.cli", "--port", str(broker.port), *creds,
            "--db", db or str(tmp_path / "fleet.db"), "--report-dir", str(tmp_path / "reports"),
            "--settle-s", "0.3"]


def have_daemon() -> bool:
    return importlib.util.find_spec("agent.daemon.main") is not None


@dataclass
class RealAgent:
    device_id: str
    state_dir: Path
    proc: subprocess.Popen[bytes]

    def jobs(self) -> list[tuple[str, str, str]]:
        """(id, type, state) of every job in the daemon's own job store."""
        with sqlite3.connect(self.state_dir / "jobs.db", timeout=10) as c:
            return [(str(a), str(b), str(s)) for a, b, s in
                    c.execute("SELECT id, type, state FROM jobs ORDER BY seq")]


@pytest.fixture
def real_agents(
    broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str],
    upstream_key: Any,  # noqa: F811 (the shared fixture, imported above)
) -> Iterator[Callable[..., list[RealAgent]]]:
    """real_agents(ids, groups): real ``edge-agent`` daemons, each with digits@1 pulled from a
    signed registry folder, its own device key, and the device data to fine-tune on."""
    if not have_daemon():
        pytest.skip("agent.daemon is not built yet")
    from tests.support.device import make_data, provision_states, publish_upstream

    started: list[RealAgent] = []

    def start(ids: list[str], groups: list[str]) -> list[RealAgent]:
        reg = publish_upstream(tmp_path / "registry", tmp_path / "ck", upstream_key)
        make_data(tmp_path / "device.npz", subprocess_env)
        provision_states([tmp_path / dev for dev in ids], reg, upstream_key, subprocess_env)
        for dev in ids:
            started.append(start_agent(dev, groups, tmp_path / dev, tmp_path, broker,
                                       subprocess_env))
        return started

    yield start
    stop_agents(started)


def start_agent(dev: str, groups: list[str], state: Path, data_root: Path,
                broker: BrokerConfig, env: dict[str, str],
                registry: dict[str, str] | None = None) -> RealAgent:
    """A real ``edge-agent`` daemon on a provisioned ``state`` (its agent.yaml written there,
    its log in state/daemon.log); ``registry``: the config's registry section, if any."""
    cfg = state / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "device_id": dev, "groups": groups, "state_dir": str(state),
        "data_root": str(data_root), **({"registry": registry} if registry else {}),
        "mqtt": {"host": broker.host, "port": broker.port, "prefix": broker.prefix,
                 "username": broker.username, "password_file": str(broker.password_file)},
        "sensors": "none", "telemetry_s": 0, "socket_group": None, "profile": "generic-x86",
    }))
    log = open(state / "daemon.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "agent.daemon", "--config", str(cfg)],
                            env=env, stdout=log, stderr=log)
    log.close()
    return RealAgent(dev, state, proc)


def stop_agents(agents: list[RealAgent]) -> None:
    for a in agents:
        a.proc.terminate()
    for a in agents:
        try:
            a.proc.wait(30)
        except subprocess.TimeoutExpired:
            a.proc.kill()
