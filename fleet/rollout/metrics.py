"""The rollout controller's Prometheus metrics: ``fleetctl controller --metrics-port PORT``.

A thread reads the controller's state db every ``refresh_s`` (its own connection, read-only
queries), never the controller's memory: what it shows is what every replica and ``fleetctl
rollout status`` see. A scrape serves the last reading: its cost is the rendering, not the
db's grouped reads (~4 ms at 1,000 series, with a garbage-collector tail of 20+ ms in a
controller's heap), and no number of scrapers adds load on the db. Rollouts are
labelled one by one while they run and for :data:`RECENT_S` after they end, so the series
stay bounded by the rollouts of a day, not of the db's life. All gauges:

- ``edgetrain_fleet_rollouts{state}``: rollouts in the db by state;
- ``edgetrain_fleet_executions{rollout, wave, kind, status}``: executions (a device's job,
  rollback or cancel) by wave and status (PLANNED, SENT, ACCEPTED, IN_PROGRESS, then the
  contract's terminal ones);
- ``edgetrain_fleet_commands_sent{rollout}`` / ``edgetrain_fleet_results_final{rollout}``:
  executions sent to their devices and finished, so far (``deriv()`` is the rate);
- ``edgetrain_fleet_wave{rollout, wave, state}``: 1 for each wave's state (pending, running,
  baking, done, aborted);
- ``edgetrain_fleet_lease_seconds{rollout, owner}``: a controller replica's live lease on a
  rollout and the seconds left on it (PostgreSQL replicas; a single SQLite controller holds
  none);
- ``edgetrain_fleet_metrics_read_timestamp_seconds``: when the series above were read (a db
  that cannot be read leaves the last reading and this time behind: alert on its age).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.db import Database
from registry.http_server import HttpLimits, HttpServer

log = logging.getLogger("fleet.metrics")

RECENT_S = 24 * 3600.0
"""How long a finished rollout keeps its own series."""

LIMITS = HttpLimits(header_timeout_s=5.0, keep_alive_s=5.0, write_timeout_s=10.0,
                    max_connections=16, max_head_bytes=8 << 10)
"""A scrape endpoint's bounds: a few Prometheus servers and people at once."""


class FleetMetrics(Collector):
    """The rollouts of the state db ``db``, read every ``refresh_s`` seconds."""

    def __init__(self, db: str | Path, refresh_s: float = 5.0) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s {refresh_s} must be > 0")
        self._db = Database(db)
        self.refresh_s = refresh_s
        self._reading: list[Metric] = []
        self._read_at = 0.0
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: HttpServer | None = None

    def serve(self, host: str, port: int) -> int:
        """``GET /metrics`` on ``host:port`` (0: a free port) from a thread; returns the port.
        The db is read once before the port opens, so the first scrape has the rollouts."""
        self.start_reading()
        self._server = HttpServer(make_asgi_app(registry=self.registry), limits=LIMITS,
                                  host=host, port=port, name="fleetctl", drain_s=1.0).start()
        return self._server.port

    def start_reading(self) -> None:
        """Read the db now, then every ``refresh_s`` from a daemon thread."""
        if self._reader is not None:
            return
        self.read()
        self._reader = threading.Thread(target=self._read_forever, name="fleet-metrics",
                                        daemon=True)
        self._reader.start()

    def read(self) -> None:
        """One reading of the db, which the scrapes serve from then on."""
        now = time.time()
        reading = list(self._read(now))  # built whole, then swapped in: a scrape sees one
        self._reading, self._read_at = reading, now

    def _read_forever(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.read()
            except Exception as e:  # a db hiccup must not end the metrics
                log.warning("metrics: the state db could not be read; the last reading stays",
                            extra={"error": str(e)})

    def close(self) -> None:
        self._stop.set()
        server, self._server = self._server, None
        if server is not None:
            server.close()
        if self._reader is not None:
            self._reader.join(30)
        self._db.close()

    def collect(self) -> Iterator[Metric]:
        yield from self._reading
        if self._read_at:
            yield GaugeMetricFamily("edgetrain_fleet_metrics_read_timestamp_seconds",
                                    "When the state db was last read for these metrics",
                                    value=self._read_at)

    def _read(self, now: float) -> Iterator[Metric]:
        db = self._db
        if not db.has_table("rollouts"):
            return  # no rollout created yet
        states = GaugeMetricFamily("edgetrain_fleet_rollouts", "Rollouts by state",
                                   labels=["state"])
        for state, n in db.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state"):
            states.add_metric([state], n)
        yield states
        recent = {"since": now - RECENT_S}
        shown = ("SELECT id FROM rollouts WHERE finished_at IS NULL OR finished_at > :since")
        execs = GaugeMetricFamily("edgetrain_fleet_executions",
                                  "Executions by rollout, wave, kind and status",
                                  labels=["rollout", "wave", "kind", "status"])
        sent = GaugeMetricFamily("edgetrain_fleet_commands_sent",
                                 "Executions sent to their devices so far", labels=["rollout"])
        final = GaugeMetricFamily("edgetrain_fleet_results_final",
                                  "Executions finished so far", labels=["rollout"])
        totals: dict[str, list[int]] = {}
        for rid, wave, kind, status, n, n_sent, n_final in db.execute(
                "SELECT rollout_id, wave, kind, status, COUNT(*), "
                "SUM(CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END), "
                "SUM(CASE WHEN finished_at IS NULL THEN 0 ELSE 1 END) FROM executions "
                f"WHERE rollout_id IN ({shown}) GROUP BY rollout_id, wave, kind, status",
                recent):
            execs.add_metric([rid, str(wave), kind, status], n)
            t = totals.setdefault(rid, [0, 0])
            t[0] += int(n_sent or 0)
            t[1] += int(n_final or 0)
        for rid, (n_sent, n_final) in sorted(totals.items()):
            sent.add_metric([rid], n_sent)
            final.add_metric([rid], n_final)
        yield from (execs, sent, final)
        waves = GaugeMetricFamily("edgetrain_fleet_wave", "Each wave's state (1)",
                                  labels=["rollout", "wave", "state"])
        for rid, idx, state in db.execute(
                f"SELECT rollout_id, idx, state FROM waves WHERE rollout_id IN ({shown}) "
                "ORDER BY rollout_id, idx", recent):
            waves.add_metric([rid, str(idx), state], 1)
        yield waves
        leases = GaugeMetricFamily("edgetrain_fleet_lease_seconds",
                                   "A replica's live lease on a rollout: seconds left",
                                   labels=["rollout", "owner"])
        if db.has_table("leases"):
            for rid, owner, expires in db.execute(
                    "SELECT rollout_id, owner, expires_at FROM leases WHERE expires_at > :now",
                    {"now": now}):
                leases.add_metric([rid, owner], round(expires - now, 3))
        yield leases
