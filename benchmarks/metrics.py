"""Prometheus endpoints: scrape cost at 1,000 series, and what metrics cost an idle daemon.

    python benchmarks/metrics.py [--series 1000] [--scrapes 300] [--idle-s 60] [--quick]

1. Each endpoint's own collector filled to about ``--series`` series: the daemon's
   (``agent.daemon.metrics.DaemonMetrics``: 64 served models, the telemetry's bound, so ~290
   series at most; 16 thermal zones, jobs in every state), ``agentctl serve``'s
   (``agent.runtime.serve_metrics.ServeMetrics``: Triton's counters and the latency histogram
   over many versions) and ``fleetctl controller``'s (``fleet.rollout.metrics.FleetMetrics``
   reading a SQLite state db of recent rollouts, waves and executions every second from its
   thread while the scrapes serve its last reading; the cost of one reading is printed
   beside). ``--scrapes`` GETs of /metrics one after the other over one kept-alive
   connection, on the project's bounded HTTP server (what the endpoints use) and, beside it in
   the same run and interleaved, on prometheus_client's own ``start_http_server`` (the
   baseline) serving the same registry. p50/p99 in ms; target p99 <= 10 ms for each.
2. Two real ``edge-agent`` processes on one broker, idle (telemetry every 10 s, no job) for
   ``--idle-s``: one without metrics, one with ``metrics: {port, refresh_s: 5}`` scraped every
   5 s as Prometheus would. RSS and CPU share of each from /proc; target: the one with metrics
   within +5% RSS of the one without, and CPU within +5% or 0.05 points of a core, whichever
   is larger (an idle daemon's CPU is a few hundredths of a percent: 5% of that is below
   /proc's tick).
"""

from __future__ import annotations

import argparse
import http.client
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402
from prometheus_client import CollectorRegistry, make_asgi_app, start_http_server  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.agent import (  # noqa: E402
    DEVICE,
    ECHO_DEVICE,
    Pinger,
    pct,
    proc_cpu_s,
    proc_rss_mb,
    provision,
)
from benchmarks.harness import fmt, parse_args, verdict  # noqa: E402
from registry.http_server import HttpServer  # noqa: E402
from tests.support.mosquitto import free_port  # noqa: E402


def daemon_registry(series: int) -> CollectorRegistry:
    from agent.daemon.metrics import DaemonMetrics, Snapshot
    from contract.messages import GovernorInfo, JobProgress, MemInfo, ServingInfo, Telemetry

    m = DaemonMetrics("bench-dev")
    # Four gauges a served model, up to the telemetry's bound of 64 models: ~290 series is
    # the most a daemon serves.
    models = min(64, max(1, (series - 40) // 4))
    m.update(Snapshot(
        broker_connected=True, outbox_messages=3,
        jobs={s: 5 for s in ("QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "CANCELED",
                             "TIMED_OUT", "REJECTED", "EXPIRED")},
        telemetry=Telemetry(
            ts=datetime.now(timezone.utc), seq=1,
            temps_c={f"zone{i}": 40.0 + i for i in range(16)}, power_mw=12000.0,
            mem=MemInfo(used_mb=3000.0, total_mb=7600.0),
            governor=GovernorInfo(state="THROTTLED", duty=0.5, reason="temp"),
            job=JobProgress(id="j", stage="finetune", step=30, total=100),
            serving={f"model-{i}": ServingInfo(processes=1, requests=1000 + i, failed=i,
                                               window_requests=100, p99_ms=4.0, slo_ms=50.0)
                     for i in range(models)})))
    return m.registry


def serve_registry(series: int) -> CollectorRegistry:
    from agent.runtime.serve_metrics import LATENCY_BUCKETS_S, ServeMetrics

    m = ServeMetrics("digits")
    # A version's series: 5 counters, a failure reason, the histogram's buckets, +Inf, sum,
    # count and created.
    per_version = 5 + 1 + len(LATENCY_BUCKETS_S) + 4
    for v in range(max(1, series // per_version)):
        for _ in range(3):
            with m.request(str(v)) as inf:
                inf.version, inf.batch, inf.compute_s = str(v), 4, 0.001
        try:
            with m.request(str(v)):
                raise ValueError("a bad request")
        except ValueError:
            pass
    return m.registry


READ_EVERY_S = 1.0
"""The controller's db readings during the benchmark: five times its default, so scrapes meet
readings more often than in a real controller."""


def controller_registry(series: int, work: Path) -> tuple[CollectorRegistry, Callable[[], None]]:
    from fleet.rollout.metrics import FleetMetrics
    from fleet.rollout.store import FleetStore

    db = work / "fleet.db"
    FleetStore(db).close()  # the schema
    now = time.time()
    rollouts = max(1, series // 25)  # 4 waves x 5 statuses, the wave states, sent and final
    with sqlite3.connect(db) as c:
        for r in range(rollouts):
            rid = f"r{r}"
            c.execute("INSERT INTO rollouts (id, nonce, plan, state, created_at, updated_at) "
                      "VALUES (?, 'n', '{}', 'running', ?, ?)", (rid, now, now))
            for w in range(4):
                c.execute("INSERT INTO waves (rollout_id, idx, target, state) VALUES "
                          "(?, ?, ?, 'running')", (rid, w, 25 * (w + 1)))
                for i, status in enumerate(("SENT", "ACCEPTED", "IN_PROGRESS", "SUCCEEDED",
                                            "FAILED")):
                    for d in range(5):
                        c.execute(
                            "INSERT INTO executions (id, rollout_id, device, wave, kind, "
                            "attempt, status, created_at, sent_at) VALUES (?, ?, ?, ?, 'job', "
                            "1, ?, ?, ?)", (f"{rid}.{w}.{i}.{d}", rid, f"dev-{w}-{i}-{d}", w,
                                            status, now, now))
    m = FleetMetrics(db, refresh_s=READ_EVERY_S)
    reads = []
    for _ in range(50):
        t0 = time.perf_counter()
        m.read()
        reads.append((time.perf_counter() - t0) * 1000)
    print(f"  fleetctl controller: one reading of the db (off the scrape path, every "
          f"{READ_EVERY_S:g} s here, 5 s by default): p50 {fmt(pct(reads, 0.5))} p99 "
          f"{fmt(pct(reads, 0.99))} ms")
    m.start_reading()  # reads on during the scrapes, as in the controller
    return m.registry, m.close


def count_series(registry: CollectorRegistry) -> int:
    from prometheus_client import generate_latest

    return sum(len(f.samples) for f in text_string_to_metric_families(
        generate_latest(registry).decode()))


def scrape_ms(port: int, n: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            body = r.read()
            out.append((time.perf_counter() - t0) * 1000)
            assert r.status == 200 and body, r.status
    finally:
        conn.close()
    return out


def scrape_cost(name: str, registry: CollectorRegistry, n: int) -> float:
    from registry.http_server import HttpLimits

    ours = HttpServer(make_asgi_app(registry=registry), limits=HttpLimits(), port=0,
                      drain_s=0.5).start()
    theirs, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        ours_ms: list[float] = []
        base_ms: list[float] = []
        scrape_ms(ours.port, 10)  # warm both
        scrape_ms(theirs.server_address[1], 10)
        for _ in range(max(1, n // 50)):  # interleaved: both see the same machine
            ours_ms += scrape_ms(ours.port, 50)
            base_ms += scrape_ms(theirs.server_address[1], 50)
    finally:
        ours.close()
        theirs.shutdown()
        theirs.server_close()
        thread.join(5)
    o50, o99, b50, b99 = (pct(ours_ms, 0.5), pct(ours_ms, 0.99), pct(base_ms, 0.5),
                          pct(base_ms, 0.99))
    print(f"  {name:<24} {count_series(registry):>6}  bounded p50 {fmt(o50):>6} p99 "
          f"{fmt(o99):>6} ms   prometheus_client p50 {fmt(b50):>6} p99 {fmt(b99):>6} ms   "
          f"p99 ratio {o99 / b99:.2f}x")
    return o99


def idle_daemons(idle_s: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """(RSS MB, CPU %) of an idle daemon without metrics and of one with them, scraped."""
    work = Path(tempfile.mkdtemp(prefix="metrics-bench-"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    broker, device_port, secrets = provision(work, env)
    port = free_port()
    procs = []
    try:
        for dev, metrics in ((DEVICE, None), (ECHO_DEVICE, {"port": port, "refresh_s": 5})):
            cfg = {"device_id": dev, "state_dir": str(work / dev / "state"),
                   "socket_group": None, "telemetry_s": 10, "sensors": "auto",
                   "mqtt": {"host": "127.0.0.1", "port": device_port, "username": dev,
                            "password_file": str(secrets / "devices" / f"{dev}.password")},
                   **({"metrics": metrics} if metrics else {})}
            (work / f"{dev}.yaml").write_text(yaml.safe_dump(cfg))
            log = open(work / f"{dev}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "agent.daemon", "--config", str(work / f"{dev}.yaml"),
                 "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=log, env=env,
                cwd=REPO))
            log.close()
        for dev in (DEVICE, ECHO_DEVICE):
            status = Pinger(broker.port, "fleet-send", secrets / "operators" /
                            "fleet-send.password", f"fleet/v1/dev/{dev}/status",
                            want='"online"')
            if not status.got.wait(60):
                raise RuntimeError(f"{dev} not online: {(work / f'{dev}.log').read_text()[-2000:]}")
            status.close()
        time.sleep(2.0)
        cpu0 = [proc_cpu_s(p.pid) for p in procs]
        t0 = time.monotonic()
        rss = [0.0, 0.0]
        next_scrape = t0
        while time.monotonic() - t0 < idle_s:
            now = time.monotonic()
            if now >= next_scrape:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    r.read()
                next_scrape = now + 5.0
            rss = [max(x, proc_rss_mb(p.pid)) for x, p in zip(rss, procs, strict=True)]
            time.sleep(0.5)
        dt = time.monotonic() - t0
        cpu = [100 * (proc_cpu_s(p.pid) - c) / dt for p, c in zip(procs, cpu0, strict=True)]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(35)
        broker.stop()
    return (rss[0], cpu[0]), (rss[1], cpu[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--idle-s", type=float, default=60.0)
    a = parse_args(ap, quick={"series": 200, "scrapes": 50, "idle_s": 3.0})
    work = Path(tempfile.mkdtemp(prefix="metrics-scrape-"))
    print(f"scrapes of GET /metrics, {a.scrapes} each, one kept-alive connection:")
    print(f"  {'endpoint':<24} {'series':>6}")
    reg, close = controller_registry(a.series, work)
    try:
        p99 = {
            "edge-agent": scrape_cost("edge-agent", daemon_registry(a.series), a.scrapes),
            "agentctl serve": scrape_cost("agentctl serve", serve_registry(a.series),
                                          a.scrapes),
            "fleetctl controller": scrape_cost("fleetctl controller", reg, a.scrapes),
        }
    finally:
        close()
    (rss_off, cpu_off), (rss_on, cpu_on) = idle_daemons(a.idle_s)
    rss_ok = rss_on <= 1.05 * rss_off
    cpu_ok = cpu_on <= max(1.05 * cpu_off, cpu_off + 0.05)
    print(f"idle edge-agent for {a.idle_s:.0f} s:   without metrics RSS {rss_off:.1f} MB, CPU "
          f"{cpu_off:.3f}%   with metrics (scraped every 5 s) RSS {rss_on:.1f} MB, CPU "
          f"{cpu_on:.3f}%   RSS ratio {rss_on / rss_off:.3f}x")
    worst = max(p99, key=lambda k: p99[k])
    verdict(f"worst /metrics p99 at {a.series} series ({worst})", p99[worst], "<=", 10.0, "ms",
            also=[("idle RSS with metrics <= 1.05x", rss_ok),
                  ("idle CPU with metrics <= 1.05x (or +0.05 pts)", cpu_ok)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
