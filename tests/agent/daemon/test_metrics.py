"""The daemon's Prometheus metrics: a real daemon on the simulated board, a real broker, GET
/metrics on a loopback port and a node_exporter textfile, both read back with
prometheus_client's parser; the broker's loss shows in them."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from agent.daemon.config import MetricsConfig
from tests.agent.daemon.conftest import AgentProc
from tests.support.mosquitto import Broker

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return parse(r.read().decode())


def wait_for(port: int, key: tuple[str, tuple[tuple[str, str], ...]], value: float,
             timeout_s: float = 20) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(port)
        if m.get(key) == value:
            return m
        assert time.monotonic() < deadline, (key, value, m.get(key))
        time.sleep(0.1)


def test_the_daemon_serves_its_metrics_and_writes_the_textfile(
        agent: Callable[..., AgentProc], mosquitto: Callable[..., Broker], tmp_path: Path
) -> None:
    broker = mosquitto()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prom = tmp_path / "textfile" / "edge-agent.prom"
    prom.parent.mkdir()
    a = agent(broker, sensors="sim", profile="sim",
              metrics={"port": port, "textfile": str(prom), "refresh_s": 0.2})
    dev = (("device", "dev-a"),)
    m = wait_for(port, ("edge_agent_broker_connected", dev), 1)
    assert m[("edge_agent_up", dev)] == 1
    temps = {k[1]: v for k, v in m.items() if k[0] == "edge_agent_temperature_celsius"}
    assert temps and all(20 < c < 110 for c in temps.values()), temps  # the simulated board
    assert 0 < m[("edge_agent_power_watts", dev)] < 100
    assert m[("edge_agent_outbox_messages", dev)] >= 0
    # A job the store refuses to run (no model installed): its terminal state is counted.
    out = a.socket_request({"op": "command", "command": {
        "v": 1, "id": "m1", "type": "deploy", "issued_at": "2026-01-01T00:00:00Z",
        "args": {"model": "digits", "version": "9"}}})
    assert out, out
    deadline = time.monotonic() + 30
    while not any(k[0] == "edge_agent_jobs" for k in scrape(port)):
        assert time.monotonic() < deadline, "no job counted"
        time.sleep(0.2)
    # The textfile holds the same families, written whole (node_exporter reads it any time).
    text = parse(prom.read_text())
    assert {k[0] for k in text} >= {"edge_agent_up", "edge_agent_broker_connected",
                                    "edge_agent_temperature_celsius", "edge_agent_jobs"}
    broker.stop()  # the link drops: the next refresh says so
    wait_for(port, ("edge_agent_broker_connected", dev), 0)
    assert a.stop() == 0


def test_a_non_loopback_metrics_host_needs_allow_remote() -> None:
    with pytest.raises(ValidationError, match="allow_remote"):
        MetricsConfig(port=9100, host="0.0.0.0")
    assert MetricsConfig(port=9100, host="0.0.0.0", allow_remote=True).host == "0.0.0.0"
    with pytest.raises(ValidationError, match="extra"):
        MetricsConfig.model_validate({"port": 9100, "path": "/x"})
