"""The fleet's broker connection: one config model and one way to build a paho client.

The fleet side never blocks in a paho callback (an exception there silently kills paho's
loop thread): ``on_message`` hands each message to a queue and returns.

This is also where a device's identity is decided, once: the sender of a message is the
device id in its topic (``{prefix}/dev/{id}/...``), which the broker's per-device ACL lets only
that device's account write (``fleetctl broker-config``). A payload whose ``device`` field names
another device is dropped here; code further in only sees :class:`DeviceMessage`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract import (
    DEFAULT_PREFIX,
    Event,
    Result,
    Status,
    Telemetry,
    Topics,
    check_id,
)

log = logging.getLogger("fleet.mqtt")

SESSION_EXPIRY_S = 7 * 24 * 3600
"""The controller's session outlives a restart: results sent while it was down wait for it."""
SESSION_TAKEN_OVER = 0x8E
"""MQTT v5 DISCONNECT reason: another connection took this client id (and its session)."""


class BrokerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=1883, gt=0, lt=65536)
    prefix: str = DEFAULT_PREFIX
    username: str | None = None
    password_file: Path | None = None
    """A file holding the password (never on the command line, where ps shows it)."""
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    keepalive_s: int = Field(default=30, ge=5)


def _nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    # QoS 1 round trips wait ~40 ms on Nagle + delayed ACK without it.
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def make_client(
    cfg: BrokerConfig,
    client_id: str,
    *,
    will: tuple[str, bytes] | None = None,
    v5: bool = True,
) -> mqtt.Client:
    """A configured, not yet connected MQTT v5 client (``v5=False``: 3.1.1 with a clean
    session); ``connect(cfg, client)`` connects it."""
    if v5:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                        protocol=mqtt.MQTTv5)
    else:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                        protocol=mqtt.MQTTv311, clean_session=True)
    c.suppress_exceptions = True
    c.on_socket_open = _nodelay
    if cfg.username:
        pw = cfg.password_file.read_text().strip() if cfg.password_file else None
        c.username_pw_set(cfg.username, pw)
    if cfg.tls_ca or cfg.tls_cert:
        c.tls_set(
            ca_certs=str(cfg.tls_ca) if cfg.tls_ca else None,
            certfile=str(cfg.tls_cert) if cfg.tls_cert else None,
            keyfile=str(cfg.tls_key) if cfg.tls_key else None,
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
    if will is not None:
        c.will_set(will[0], will[1], qos=1, retain=True)
    return c


def connect_props(persistent: bool) -> Properties | None:
    if not persistent:
        return None
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = SESSION_EXPIRY_S
    return props


DeviceBody = Status | Telemetry | Result | Event
_MODELS: dict[str, Any] = {"status": Status, "telemetry": Telemetry, "res": Result, "evt": Event}


@dataclass(frozen=True)
class DeviceMessage:
    """One message a device sent, validated, with its sender taken from the topic."""

    device: str
    """The device id from the topic: the only identity the fleet believes."""
    kind: str
    """status | telemetry | res | evt"""
    sub: str | None
    """The event kind of an ``evt`` topic."""
    body: DeviceBody | None
    """None only for a cleared retained status (a decommissioned device)."""


def device_message(topics: Topics, topic: str, payload: bytes) -> DeviceMessage | None:
    """The typed message on a device topic, or None (logged) for a foreign topic, an
    unreadable payload, or a payload that claims to come from another device."""
    try:
        kind, device, sub = topics.parse(topic)
        check_id(device)  # it becomes a key in the store and a row in reports
    except ValueError:
        log.warning("message on a foreign topic ignored", extra={"topic": topic})
        return None
    model = _MODELS.get(kind)
    if model is None:
        return None  # commands: the fleet's own (or another operator's) sends
    if kind == "status" and not payload:
        return DeviceMessage(device, kind, sub, None)
    try:
        body = model.from_payload(payload)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(payload)"
        log.warning("unreadable message ignored",
                    extra={"topic": topic, "error": f"{where}: {err['msg']}"})
        return None
    claimed = getattr(body, "device", device)  # telemetry names no device
    if claimed != device:
        # The ACL proves who wrote this topic; the payload is only what the writer says.
        log.warning("message claiming another device ignored",
                    extra={"topic": topic, "claimed_device": claimed})
        return None
    return DeviceMessage(device, kind, sub, body)


class FleetConnection:
    """A threaded paho client whose messages land in a queue for one consumer thread.

    ``persistent`` + a fixed ``client_id`` = a durable session: QoS 1 results published while
    this process was down are delivered when it comes back. ``v5=False``: MQTT 3.1.1, for a
    connection that only watches (no session, no properties): paho builds an MQTT v5
    ``Properties`` object for every message it receives, ~0.1 ms each, which is most of a
    watcher's cost when 10,000 devices change status at once.
    """

    def __init__(
        self,
        cfg: BrokerConfig,
        client_id: str,
        subscriptions: list[str],
        *,
        persistent: bool = False,
        v5: bool = True,
    ) -> None:
        if persistent and not v5:
            raise ValueError("a persistent session needs MQTT v5 (its session expiry)")
        self.cfg = cfg
        self.v5 = v5
        self.topics = Topics(cfg.prefix)
        self.subscriptions = subscriptions
        self.persistent = persistent
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.client = make_client(cfg, client_id, v5=v5)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.client.on_disconnect = self._on_disconnect
        self.client.reconnect_delay_set(0.5, 10)

    def _on_connect(self, client: mqtt.Client, ud: Any, flags: Any, rc: Any, props: Any) -> None:
        if rc.is_failure:
            return
        self.connected.set()
        if self.subscriptions:
            client.subscribe([(t, 1) for t in self.subscriptions])
        else:
            self.subscribed.set()

    def _on_subscribe(self, client: mqtt.Client, ud: Any, mid: int, rcs: Any, props: Any) -> None:
        self.subscribed.set()

    def _on_message(self, client: mqtt.Client, ud: Any, msg: mqtt.MQTTMessage) -> None:
        self.inbox.put(msg)

    def _on_disconnect(self, client: mqtt.Client, ud: Any, flags: Any, rc: Any, p: Any) -> None:
        self.connected.clear()
        if getattr(rc, "value", None) == SESSION_TAKEN_OVER:
            # A broker that binds client ids to accounts (fleetctl broker-config) gives an
            # account one live connection: another login with it replaced this one.
            log.error("the broker handed this connection's session to another login with "
                      "the same account: give each fleetctl that runs beside another its own "
                      "account (fleetctl broker-config --operator NAME=ROLE)",
                      extra={"username": self.cfg.username})

    def start(self, timeout_s: float = 10.0) -> None:
        """Connect and subscribe, or raise ConnectionError naming the broker."""
        where = f"{self.cfg.host}:{self.cfg.port}"
        try:
            session: dict[str, Any] = ({"clean_start": not self.persistent,
                                         "properties": connect_props(self.persistent)}
                                        if self.v5 else {})
            self.client.connect(self.cfg.host, self.cfg.port, keepalive=self.cfg.keepalive_s,
                                **session)
        except OSError as e:
            raise ConnectionError(f"MQTT broker {where} unreachable: {e}") from None
        self.client.loop_start()
        if not self.subscribed.wait(timeout_s):
            self.stop()
            raise ConnectionError(f"MQTT broker {where}: no CONNACK/SUBACK in {timeout_s:.0f} s")

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        # Queued in paho's memory while disconnected; the controller's store, not paho, is
        # what makes a send survive a crash (it is re-sent with the same id on restart).
        self.client.publish(topic, payload, qos=qos, retain=retain)

    def receive(self, timeout_s: float, max_n: int = 5000) -> list[DeviceMessage]:
        """Device messages that arrived, waiting up to ``timeout_s`` for the first; each
        checked by :func:`device_message` (the rest are dropped there)."""
        return self.receive_counted(timeout_s, max_n)[1]

    def receive_counted(self, timeout_s: float,
                        max_n: int = 5000) -> tuple[int, list[DeviceMessage]]:
        """(how many messages arrived, those of them :func:`device_message` kept): a caller
        that waits for a quiet broker counts a dropped message as one that came."""
        raw: list[mqtt.MQTTMessage] = []
        try:
            raw.append(self.inbox.get(timeout=timeout_s))
        except queue.Empty:
            return 0, []
        while len(raw) < max_n:
            try:
                raw.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        out = [device_message(self.topics, m.topic, m.payload) for m in raw]
        return len(raw), [m for m in out if m is not None]

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until paho has no outgoing packet left (so an exit does not drop sends)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.client._out_message_mutex:
                pending = len(self.client._out_messages)
            if pending == 0 and not self.client.want_write():
                return
            time.sleep(0.02)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
