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


def test_the_metrics_endpoint_holds_a_bounded_number_of_connections() -> None:
    from agent.daemon.metrics import LIMITS, DaemonMetrics, Snapshot

    m = DaemonMetrics("dev-b")
    m.update(Snapshot(broker_connected=True, outbox_messages=3))
    port = m.serve("127.0.0.1", 0)
    try:
        assert scrape(port)[("edge_agent_outbox_messages", (("device", "dev-b"),))] == 3
        # Idle connections up to the bound are held; one more is answered 503 and closed,
        # and a scrape gets through again once they go.
        held = [socket.create_connection(("127.0.0.1", port), timeout=5)
                for _ in range(LIMITS.max_connections)]
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(64).startswith(b"HTTP/1.1 503"), "over the bound, not refused"
        for s in held:
            s.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert scrape(port)[("edge_agent_up", (("device", "dev-b"),))] == 1
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        m.close()


def test_the_grafana_dashboard_queries_only_what_the_daemon_exposes() -> None:
    from datetime import datetime, timezone

    from prometheus_client import generate_latest

    from agent.daemon.metrics import DaemonMetrics, Snapshot
    from contract.messages import GovernorInfo, JobProgress, MemInfo, ServingInfo, Telemetry
    from tests.support.grafana import dashboard, queried_metrics

    d = dashboard()
    assert d["uid"] and len({p["id"] for p in d["panels"]}) == len(d["panels"])
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in d["panels"])
    # Every gauge there is: a job running under the governor, a model being served.
    m = DaemonMetrics("dev-c")
    m.update(Snapshot(broker_connected=True, outbox_messages=1, jobs={"SUCCEEDED": 2},
                      telemetry=Telemetry(
                          ts=datetime(2026, 1, 1, tzinfo=timezone.utc), seq=1,
                          temps_c={"cpu": 51.0}, power_mw=9000.0,
                          mem=MemInfo(used_mb=900.0, total_mb=7600.0),
                          governor=GovernorInfo(state="throttled", duty=0.5, reason="temp"),
                          job=JobProgress(id="j", stage="finetune", step=3, total=10),
                          serving={"digits": ServingInfo(processes=1, requests=5, failed=0,
                                                         window_requests=5, p99_ms=4.0,
                                                         slo_ms=50.0)})))
    exposed = {f.name for f in text_string_to_metric_families(
        generate_latest(m.registry).decode())}
    queried = queried_metrics("edge_agent_")
    assert len(queried) >= 10, queried
    assert queried <= exposed, sorted(queried - exposed)
