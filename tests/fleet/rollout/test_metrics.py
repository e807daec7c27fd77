"""``fleetctl controller --metrics-port``: the rollouts' Prometheus metrics, scraped from the
real controller driving simulated devices over a real broker, parsed with prometheus_client's
own parser; on PostgreSQL the replica's lease shows while it holds the rollout."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.mqtt import BrokerConfig
from fleet.rollout.metrics import FleetMetrics
from fleet.rollout.store import FleetStore
from fleet.sim.fleet import SimFleet
from tests.fleet.conftest import BOTH_ENGINES, fleetctl_argv
from tests.support.grafana import queried_metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def named(m: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in m.items() if n == name}


@BOTH_ENGINES
def test_the_controller_serves_its_rollouts_as_metrics(
    sim_fleet: Callable[..., SimFleet], broker: BrokerConfig, tmp_path: Path, fleet_db: str,
    subprocess_env: dict[str, str],
) -> None:
    sim_fleet(devices=12, behavior={"job_duration_s": 0.4})
    base = [*fleetctl_argv(broker, tmp_path, fleet_db), "--lease-s", "5"]
    ctl = subprocess.Popen([*base, "controller", "--forever", "--metrics-port", "0",
                            "--metrics-refresh-s", "0.2"],
                           env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        assert ctl.stdout is not None
        url = json.loads(ctl.stdout.readline())["metrics"]
        assert url.startswith("http://127.0.0.1:")
        r = subprocess.run([*base, "rollout", "create", "--name", "m", "--group", "sim",
                            "--job", "deploy", "--args", '{"version": "v2"}', "--waves",
                            "1,50%,100%", "--bake-s", "0.5", "--detach"],
                           env=subprocess_env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        leases: list[dict] = []
        deadline = time.monotonic() + 60
        while True:
            m = scrape(url)
            leases += [dict(k) for k in named(m, "edgetrain_fleet_lease_seconds")]
            if m.get(("edgetrain_fleet_rollouts", (("state", "succeeded"),))) == 1:
                break
            assert ctl.poll() is None and time.monotonic() < deadline, ctl.stderr.read()
            time.sleep(0.1)
    finally:
        ctl.terminate()
        ctl.wait(30)
    execs = named(m, "edgetrain_fleet_executions")
    jobs = {dict(k)["wave"]: v for k, v in execs.items() if dict(k)["kind"] == "job"}
    assert jobs == {"0": 1, "1": 5, "2": 6}  # all SUCCEEDED, wave by wave
    assert {dict(k)["status"] for k in execs} == {"SUCCEEDED"}
    assert m[("edgetrain_fleet_commands_sent", (("rollout", "m"),))] == 12
    assert m[("edgetrain_fleet_results_final", (("rollout", "m"),))] == 12
    # The repository's Grafana dashboard queries no controller metric that is not here.
    queried = queried_metrics("edgetrain_fleet_")
    assert len(queried) == 5 and queried <= {k[0] for k in m} | {
        "edgetrain_fleet_lease_seconds"}, queried  # a lease shows only while one is held
    waves = named(m, "edgetrain_fleet_wave")
    assert sorted((dict(k)["wave"], dict(k)["state"]) for k in waves) == [
        ("0", "done"), ("1", "done"), ("2", "done")]
    if fleet_db.startswith("postgresql"):  # a replica held the rollout while it ran
        assert leases and {x["rollout"] for x in leases} == {"m"}
    else:
        assert not leases


def test_a_remote_metrics_host_needs_the_flag_that_allows_it(
    broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    r = subprocess.run([*fleetctl_argv(broker, tmp_path), "controller", "--metrics-port", "0",
                        "--metrics-host", "0.0.0.0"], env=subprocess_env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--metrics-allow-remote" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "fleet.db").exists()  # refused before anything was opened


@pytest.mark.parametrize("flag", ["--metrics-port=x", "--metrics-port=-",
                                  "--metrics-refresh-s=0", "--metrics-refresh-s=x"])
def test_a_bad_metrics_flag_is_a_usage_error(
    flag: str, broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    r = subprocess.run([*fleetctl_argv(broker, tmp_path), "controller", flag],
                       env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and flag.split("=")[0] in r.stderr, r.stderr


def test_scrapes_serve_the_last_reading_and_a_db_that_fails_keeps_it(tmp_path: Path) -> None:
    """The db is read every refresh_s, not at each scrape; a reading that fails leaves the last
    one (and its timestamp, which says how old it is) instead of empty metrics."""
    db = tmp_path / "fleet.db"
    FleetStore(db).close()
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO rollouts (id, nonce, plan, state, created_at, updated_at) "
                  "VALUES ('r1', 'n', '{}', 'running', 1, 1)")
    m = FleetMetrics(db, refresh_s=0.05)
    try:
        port = m.serve("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/metrics"
        first = scrape(url)
        assert first[("edgetrain_fleet_rollouts", (("state", "running"),))] == 1
        with sqlite3.connect(db) as c:
            c.execute("UPDATE rollouts SET state = 'succeeded'")
        deadline = time.monotonic() + 10
        while ("edgetrain_fleet_rollouts", (("state", "succeeded"),)) not in scrape(url):
            assert time.monotonic() < deadline, "the db change never showed"
            time.sleep(0.05)
        with sqlite3.connect(db) as c:
            c.execute("ALTER TABLE executions RENAME TO executions_gone")
        time.sleep(0.3)  # several failed readings
        stale = scrape(url)
        time.sleep(0.3)
        again = scrape(url)
        stamp = ("edgetrain_fleet_metrics_read_timestamp_seconds", ())
        assert stale[("edgetrain_fleet_rollouts", (("state", "succeeded"),))] == 1
        assert again[stamp] == stale[stamp]  # nothing read since: its age grows
        assert time.time() - again[stamp] >= 0.3
    finally:
        m.close()
