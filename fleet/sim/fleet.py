"""``SimFleet``: many simulated devices on ONE thread. Every device's paho client is driven
through paho's external-loop API from one selector (epoll), together with the timers that stand
in for the devices' jobs, so 1,000 devices cost one thread, not 1,000. Also what a test needs
from outside that thread: start (wait until all are connected), stop, crash a device (no
DISCONNECT: the broker sends its last will) and a summary of what each device ran.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from contract import Topics
from fleet.mqtt import BrokerConfig
from fleet.sim.config import SimConfig
from fleet.sim.device import SimDevice


class SimFleet:
    """Many :class:`SimDevice` on one selector thread."""

    def __init__(self, cfg: SimConfig, broker: BrokerConfig,
                 password_dir: Path | None = None) -> None:
        """``password_dir``: each device logs in with its own account, as ``fleetctl
        broker-config`` provisions it (username = device id, password in
        ``password_dir/<id>.password``); without it every device uses ``broker``'s."""
        self.cfg = cfg
        self.broker = broker
        self.password_dir = password_dir
        self.topics = Topics(broker.prefix)
        self.sel = selectors.DefaultSelector()
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tseq = itertools.count()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: deque[Callable[[], None]] = deque()
        self.devices = {
            d: SimDevice(self, d, cfg.behavior_of(cfg.first_index + i, d))
            for i, d in enumerate(cfg.device_ids())
        }
        self.connected_count = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def broker_for(self, device_id: str) -> BrokerConfig:
        """The connection settings of one device (its own account with ``password_dir``)."""
        if self.password_dir is None:
            return self.broker
        return self.broker.model_copy(update={
            "username": device_id, "password_file": self.password_dir / f"{device_id}.password"})

    # --- paho external loop ----------------------------------------------------------

    def attach(self, c: mqtt.Client) -> None:
        nodelay = c.on_socket_open

        def opened(client: mqtt.Client, ud: Any, sock: Any) -> None:
            if nodelay is not None:
                nodelay(client, ud, sock)
            self.sel.register(sock, selectors.EVENT_READ, client)

        def closed(client: mqtt.Client, ud: Any, sock: Any) -> None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(sock)

        def want_write(client: mqtt.Client, ud: Any, sock: Any) -> None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

        def done_write(client: mqtt.Client, ud: Any, sock: Any) -> None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.modify(sock, selectors.EVENT_READ, client)

        c.on_socket_open = opened
        c.on_socket_close = closed
        c.on_socket_register_write = want_write
        c.on_socket_unregister_write = done_write

    def publish(self, dev: SimDevice, topic: str, payload: bytes) -> None:
        # QoS 1 while disconnected stays in paho's memory and goes out after reconnect.
        if dev.client is not None:
            dev.client.publish(topic, payload, qos=1)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay_s, next(self._tseq), fn))

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        for d in self.devices.values():
            d.connect()
        last_misc = time.monotonic()
        last_tel = last_misc
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = 0.2 if not self.timers else max(0.0, min(0.2, self.timers[0][0] - now))
            for key, mask in self.sel.select(timeout):
                client = key.data
                if client is None:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                if mask & selectors.EVENT_READ:
                    client.loop_read()
                if mask & selectors.EVENT_WRITE:
                    client.loop_write()
            while self._calls:
                self._calls.popleft()()
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, fn = heapq.heappop(self.timers)
                try:
                    fn()
                except Exception as e:
                    self.errors.append(repr(e))
            if now - last_misc >= 1.0:
                last_misc = now
                for d in self.devices.values():
                    if d.client is not None and d.client.loop_misc() != mqtt.MQTT_ERR_SUCCESS:
                        self._reconnect(d)
            if self.cfg.telemetry_s and now - last_tel >= self.cfg.telemetry_s:
                last_tel = now
                for d in self.devices.values():
                    d.send_telemetry()
        for d in self.devices.values():  # a clean exit says offline itself (no last will)
            if d.client is not None and d.online:
                off = d.status("offline").to_payload()
                d.client.publish(self.topics.status(d.id), off, 1, True)
                d.client.loop_write()
                d.client.disconnect()
                d.client.loop_write()

    def _reconnect(self, d: SimDevice) -> None:
        assert d.client is not None
        with contextlib.suppress(OSError):  # retried at the next misc tick (1 s)
            d.client.reconnect()

    def crash(self, device_id: str) -> None:
        """Drop a device's TCP connection without DISCONNECT: the broker sends its last will,
        and the device stays off until :meth:`revive`."""
        def do() -> None:
            d = self.devices[device_id]
            if d.client is not None:
                sock = d.client.socket()
                d.client.on_disconnect = None
                if d.online:
                    self.connected_count -= 1
                d.online = False
                if sock is not None:
                    self.sel.unregister(sock)
                    sock.close()
                d.client = None
        self.call_soon_threadsafe(do)

    def start(self, timeout_s: float = 60.0) -> SimFleet:
        self._thread = threading.Thread(target=self._run, name="sim-fleet", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while self.connected_count < len(self.devices):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {self.connected_count}/{len(self.devices)} simulated devices connected"
                )
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._stop.set()
        self.call_soon_threadsafe(lambda: None)
        if self._thread is not None:
            self._thread.join(10)

    def summary(self) -> dict[str, Any]:
        return {
            "devices": len(self.devices),
            "executed": {d.id: list(d.executed) for d in self.devices.values() if d.executed},
            "models": {d.id: d.model.version for d in self.devices.values()},
            "duplicates": sum(d.duplicates for d in self.devices.values()),
            "errors": self.errors,
        }
