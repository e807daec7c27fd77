"""The daemon's Prometheus metrics: what its telemetry says, for Grafana instead of MQTT.

Off unless agent.yaml's ``metrics`` section sets a port (``GET /metrics``: prometheus_client's
ASGI app on the project's bounded server, :data:`LIMITS`, on loopback unless
``allow_remote``) or a textfile for node_exporter's textfile collector. The main loop takes a
snapshot every ``refresh_s`` (sensors, the running job and its governor, the serving
runtimes, the job store's states, the outbox's depth, the broker link); a scrape reads that
snapshot and never touches the sensors, the stores or the link from the server's thread.
All gauges, labelled ``device``:

- ``edge_agent_up`` 1; ``edge_agent_broker_connected`` 0/1; ``edge_agent_outbox_messages``
  (results and events not yet acknowledged by the broker);
- ``edge_agent_jobs{state}``: jobs in the store by state (QUEUED, IN_PROGRESS, SUCCEEDED,
  FAILED, ...);
- ``edge_agent_temperature_celsius{zone}``, ``edge_agent_power_watts`` (the board's total),
  ``edge_agent_memory_used_bytes`` / ``edge_agent_memory_total_bytes``;
- while a job runs: ``edge_agent_job_step`` / ``edge_agent_job_steps{job, stage}``,
  ``edge_agent_governor_duty`` and ``edge_agent_governor_state{state, reason}`` (1);
- per served model: ``edge_agent_serving_requests{model}``, ``..._failed``,
  ``edge_agent_serving_p99_seconds`` and ``edge_agent_serving_slo_seconds``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, make_asgi_app, write_to_textfile
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.daemon.config import MetricsConfig
from agent.jobs.store import JobStore
from agent.mqtt.link import MqttLink
from agent.mqtt.outbox import Outbox
from contract import Telemetry
from registry.http_server import HttpLimits, HttpServer

log = logging.getLogger("agent.daemon")

LIMITS = HttpLimits(header_timeout_s=5.0, keep_alive_s=5.0, write_timeout_s=10.0,
                    max_connections=8, max_head_bytes=8 << 10)
"""A scrape endpoint's bounds: a few scrapers at once (Prometheus, an agent, a person with
curl), a head in 5 s; prometheus_client's own server takes every connection in a thread of
its own, unbounded."""


@dataclass(frozen=True)
class Snapshot:
    """What one refresh read; the scrape renders it."""

    telemetry: Telemetry | None = None
    broker_connected: bool = False
    outbox_messages: int = 0
    jobs: dict[str, int] = field(default_factory=dict)


class DaemonMetrics(Collector):
    """The collector over the latest :class:`Snapshot`, its registry, and its outlets."""

    def __init__(self, device: str, textfile: Path | None = None,
                 refresh_s: float = 5.0) -> None:
        self.device, self.textfile, self.refresh_s = device, textfile, refresh_s
        self._next = 0.0
        self._lock = threading.Lock()
        self._snap = Snapshot()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: HttpServer | None = None
        self.port: int | None = None
        """Where GET /metrics listens once started (a port of 0 in the config: a free one)."""

    @classmethod
    def of(cls, cfg: MetricsConfig, device: str) -> DaemonMetrics | None:
        """The daemon's metrics as agent.yaml asks (None: neither a port nor a textfile)."""
        if cfg.port is None and cfg.textfile is None:
            return None
        return cls(device, cfg.textfile, cfg.refresh_s)

    def start(self, cfg: MetricsConfig) -> None:
        """GET /metrics on the configured port; a port that cannot be had is logged, and the
        daemon runs on without it."""
        if cfg.port is None:
            return
        try:
            self.port = self.serve(cfg.host, cfg.port)
        except OSError as e:
            log.error("metrics: cannot listen on %s:%s (%s): no /metrics", cfg.host, cfg.port,
                      e)
            return
        log.info("metrics: GET http://%s:%d/metrics", cfg.host, self.port,
                 extra={"fields": {"event": "metrics", "port": self.port}})

    def tick(self, now: float, reading: Callable[[], Telemetry], *, link: MqttLink,
             outbox: Outbox, store: JobStore) -> float:
        """From the main loop's turn at ``now`` (monotonic): refresh when due (an error is
        logged, never raised); returns when the next refresh is due."""
        if now >= self._next:
            try:
                self.refresh(reading(), link=link, outbox=outbox, store=store)
            except Exception:
                log.exception("metrics refresh failed")
            self._next = now + self.refresh_s
        return self._next

    def refresh(self, reading: Telemetry, *, link: MqttLink, outbox: Outbox,
                store: JobStore) -> None:
        """A snapshot for the scrapes (from the main loop), and the textfile rewritten."""
        (depth,) = outbox.query("SELECT COUNT(*) FROM outbox")[0]
        self.update(Snapshot(telemetry=reading, broker_connected=link.connected,
                             outbox_messages=int(depth), jobs=store.counts()))
        if self.textfile is not None:
            self.write_textfile(self.textfile)

    def update(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._snap = snapshot

    def serve(self, host: str, port: int) -> int:
        """Start ``GET /metrics`` on ``host:port`` (0: a free port); returns the port."""
        self._server = HttpServer(make_asgi_app(registry=self.registry), limits=LIMITS,
                                  host=host, port=port, name="edge-agent", drain_s=1.0).start()
        return self._server.port

    def write_textfile(self, path: Path) -> None:
        """The metrics as a node_exporter .prom file (written to a temp file, then renamed)."""
        write_to_textfile(str(path), self.registry)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snap = self._snap
        dev = {"device": self.device}

        def gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=[*dev, *labels])
            g.add_metric([self.device, *labels.values()], value)
            return g

        yield gauge("edge_agent_up", "1 while the daemon runs", 1)
        yield gauge("edge_agent_broker_connected", "1 while the MQTT link is up",
                    float(snap.broker_connected))
        yield gauge("edge_agent_outbox_messages", "Messages not yet acknowledged by the broker",
                    snap.outbox_messages)
        jobs = GaugeMetricFamily("edge_agent_jobs", "Jobs in the store by state",
                                 labels=["device", "state"])
        for state, n in sorted(snap.jobs.items()):
            jobs.add_metric([self.device, state], n)
        yield jobs
        t = snap.telemetry
        if t is None:
            return
        temps = GaugeMetricFamily("edge_agent_temperature_celsius", "Temperature by zone",
                                  labels=["device", "zone"])
        for zone, c in sorted(t.temps_c.items()):
            temps.add_metric([self.device, zone], c)
        yield temps
        if t.power_mw is not None:
            yield gauge("edge_agent_power_watts", "The board's power draw", t.power_mw / 1000)
        if t.mem is not None:
            yield gauge("edge_agent_memory_used_bytes", "Memory in use", t.mem.used_mb * 2**20)
            yield gauge("edge_agent_memory_total_bytes", "Memory in all", t.mem.total_mb * 2**20)
        if t.job is not None:
            job = {"job": t.job.id, "stage": t.job.stage}
            if t.job.step is not None:
                yield gauge("edge_agent_job_step", "The running job's step", t.job.step, **job)
            if t.job.total is not None:
                yield gauge("edge_agent_job_steps", "The running job's steps in all",
                            t.job.total, **job)
        if t.governor is not None:
            if t.governor.duty is not None:
                yield gauge("edge_agent_governor_duty", "The fine-tune's duty cycle (0-1)",
                            t.governor.duty)
            yield gauge("edge_agent_governor_state", "The governor's state (1) and what limits",
                        1, state=t.governor.state, reason=t.governor.reason or "")
        for name, doc, value_of in (
                ("edge_agent_serving_requests", "Requests answered and failed since each "
                 "serving process started", lambda s: s.requests),
                ("edge_agent_serving_failed", "Requests failed since each serving process "
                 "started", lambda s: s.failed),
                ("edge_agent_serving_p99_seconds", "The worst serving process's p99 over its "
                 "window", lambda s: None if s.p99_ms is None else s.p99_ms / 1000),
                ("edge_agent_serving_slo_seconds", "The application's p99 objective",
                 lambda s: None if s.slo_ms is None else s.slo_ms / 1000)):
            g = GaugeMetricFamily(name, doc, labels=["device", "model"])
            for model, info in sorted((t.serving or {}).items()):
                value = value_of(info)
                if value is not None:
                    g.add_metric([self.device, model], value)
            yield g
