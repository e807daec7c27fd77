"""``fleetctl dashboard`` put together: the state db reader, the device table over MQTT, the
live hub, the application and the bounded HTTP server it runs on
(``registry.http_server``), started and closed in order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.dashboard.app import Dashboard
from fleet.dashboard.auth import Operators
from fleet.dashboard.devices import DeviceBoard
from fleet.dashboard.live import Hub
from fleet.dashboard.snapshot import FleetReader
from fleet.mqtt import BrokerConfig
from registry.credentials import is_loopback
from registry.http_server import HttpLimits, HttpServer

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")



def limits(max_live: int) -> HttpLimits:
    """Each live page holds one connection; room beside them for the page's own requests."""
    return HttpLimits(header_timeout_s=10.0, keep_alive_s=5.0, write_timeout_s=15.0,
                      max_connections=max_live + 32, max_head_bytes=16 << 10)


def origins(host: str, port: int, extra: list[str]) -> set[str]:
    """The origins the page is reached at: the bound address (every loopback name when it is
    loopback) and the operator's ``--origin`` ones."""
    out = {o.rstrip("/") for o in extra}
    if is_loopback(host):
        out |= {f"http://{h}:{port}" for h in LOOPBACK_NAMES}
    elif host not in ("0.0.0.0", "::"):
        shown = f"[{host}]" if ":" in host else host
        out.add(f"http://{shown}:{port}")
    return out


@dataclass
class Options:
    db: str
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    extra_origins: tuple[str, ...] = ()
    max_live: int = 32
    period_s: float = 0.25


class DashboardServer:
    """Everything ``fleetctl dashboard`` runs; :meth:`start` then :meth:`close`."""

    def __init__(self, opts: Options, broker: BrokerConfig | None,
                 membership: Mapping[str, list[str]] | None = None) -> None:
        self.opts = opts
        self.reader = FleetReader(opts.db)
        self.board = (DeviceBoard(broker, f"fleetctl-dashboard-{os.getpid()}", membership)
                      if broker is not None else None)
        self.hub = Hub(self.reader, self.board, period_s=opts.period_s,
                       max_clients=opts.max_live)
        self.operators = Operators(opts.token, set())
        self.dashboard = Dashboard(self.hub, self.operators, opts.db)
        self.http = HttpServer(self.dashboard.app, limits=limits(opts.max_live),
                               host=opts.host, port=opts.port, name="fleetctl-dashboard",
                               drain_s=2.0)
        # The origins name the port, known once it is bound (0: a free one).
        self.operators.allow(origins(opts.host, self.http.port, list(opts.extra_origins)))

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.opts.host in ("0.0.0.0", "localhost") else self.opts.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.http.port}/"

    def start(self, connect_timeout_s: float = 10.0) -> DashboardServer:
        if self.board is not None:
            self.board.start(connect_timeout_s)
        self.hub.start()
        self.http.start()
        return self

    def close(self) -> None:
        self.hub.close()  # the live streams end first: the server's drain is not held by them
        self.http.close()
        if self.board is not None:
            self.board.close()
        self.dashboard.close()
        self.reader.close()
