"""The device's MQTT connection: paho 2.x, MQTT v5, a persistent session, jittered back-off.

- ``clean_start=False`` plus a Session Expiry Interval: commands sent while the device is
  offline wait at the broker (either setting alone loses them).
- Our own reconnect loop with full jitter (paho's back-off has none; a fleet that lost its
  broker must not come back in lock-step).
- TCP_NODELAY on the socket (Nagle costs ~90 ms per QoS 1 round trip on loopback).
- A Maximum Packet Size in CONNECT (MQTT v5): the broker must not send this client anything
  larger, so an oversized command is dropped at the broker instead of being read into the
  daemon's memory whole before the contract's 64 KiB check (paho buffers a packet entirely).
- Every callback catches everything (an exception would silently kill paho's thread) and
  returns at once: ``on_message`` hands the payload to the daemon's handler, which validates,
  persists and queues work elsewhere.
- QoS 1 messages go through the on-disk :class:`~agent.mqtt.outbox.Outbox`; the row is deleted
  on PUBACK. paho itself resends what was in flight when a connection dropped, so the link
  only publishes rows that this process has not handed to paho yet.
"""

from __future__ import annotations

import base64
import logging
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt.outbox import Outbox, OutMessage
from contract import MAX_PAYLOAD_BYTES

log = logging.getLogger("agent.mqtt")

MAX_INBOUND_PACKET_BYTES = MAX_PAYLOAD_BYTES + 4096
"""The largest packet the broker may send us: a contract-sized command plus its topic and v5
properties. A command just over 64 KiB still arrives and is REJECTED TOO_LARGE; a far larger
one never leaves the broker (which drops it for this client)."""


@dataclass(frozen=True)
class Inbound:
    topic: str
    payload: bytes
    response_topic: str | None
    correlation_data: bytes | None


@dataclass
class LinkSettings:
    client_id: str
    host: str
    port: int
    keepalive_s: int = 30
    session_expiry_s: int = 7 * 24 * 3600
    username: str | None = None
    password: str | None = None
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    tls: bool = False
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 60.0


def backoff_s(attempt: int, min_s: float, max_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [min, min(max, min * 2**attempt)]."""
    return rng.uniform(min_s, min(max_s, min_s * (2 ** min(attempt, 30))))


def publish_props(props: dict[str, Any] | None) -> Properties | None:
    if not props:
        return None
    p = Properties(PacketTypes.PUBLISH)
    if props.get("expiry_s"):
        p.MessageExpiryInterval = int(props["expiry_s"])
    if props.get("correlation_data_b64"):
        p.CorrelationData = base64.b64decode(props["correlation_data_b64"])
    return p


class MqttLink:
    """``start()`` connects in a background thread and keeps reconnecting until ``stop()``.

    ``before_connect()`` returns the will ``(topic, payload)`` for the next attempt (the daemon
    bumps ``conn_seq`` there); ``on_connected()`` runs on each CONNACK (subscribe, publish the
    online status); ``on_inbound(Inbound)`` gets each message and must not block.
    """

    def __init__(
        self, settings: LinkSettings, outbox: Outbox, *,
        before_connect: Callable[[], tuple[str, bytes]],
        on_connected: Callable[[bool], None],
        on_inbound: Callable[[Inbound], None],
    ) -> None:
        self.s = settings
        self.outbox = outbox
        self._before_connect = before_connect
        self._on_connected = on_connected
        self._on_inbound = on_inbound
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None
        self._pub_lock = threading.Lock()
        self._handed_up_to = 0  # highest outbox rowid given to paho by this process
        # What each QoS 1 mid in flight stands for: an outbox row to forget, or a waiter.
        # Held across client.publish() so a PUBACK cannot be settled before its mid is known,
        # and never taken inside a paho callback: paho holds its own locks there (see
        # _published), and taking ours inside was a lock-order deadlock with publish().
        self._inflight_lock = threading.Lock()
        self._inflight: dict[int, int | threading.Event] = {}
        self._acks: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._rng = random.Random()
        self.connects = 0
        self.client = self._make_client()

    # -- set-up -------------------------------------------------------------------------

    def _make_client(self) -> mqtt.Client:
        c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=self.s.client_id, protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        c.suppress_exceptions = True
        c.max_inflight_messages_set(100)
        if self.s.username is not None:
            c.username_pw_set(self.s.username, self.s.password)
        if self.s.tls or self.s.ca is not None:
            ctx = ssl.create_default_context(cafile=str(self.s.ca) if self.s.ca else None)
            if self.s.cert is not None and self.s.key is not None:
                ctx.load_cert_chain(str(self.s.cert), str(self.s.key))
            c.tls_set_context(ctx)
        c.on_socket_open = self._nodelay
        c.on_connect = self._connack
        c.on_disconnect = self._disconnected
        c.on_message = self._message
        c.on_publish = self._published
        return c

    @staticmethod
    def _nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
        try:
            raw = sock if isinstance(sock, socket.socket) else getattr(sock, "_sock", sock)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except Exception as e:  # a websocket or exotic socket: latency only
            log.debug("TCP_NODELAY not set: %s", e)

    # -- callbacks (paho's thread: never raise, never block) -----------------------------

    def _connack(self, c: mqtt.Client, ud: Any, flags: Any, rc: Any, props: Any) -> None:
        try:
            if rc.is_failure:
                log.warning("broker %s:%s refused the connection: %s", self.s.host, self.s.port,
                            rc)
                return
            self.connects += 1
            self._connected.set()
            log.info("connected to %s:%s (session present: %s)", self.s.host, self.s.port,
                     flags.session_present)
            self._on_connected(bool(flags.session_present))
            self.flush()
        except Exception:
            log.exception("on_connect handler failed")

    def _disconnected(self, c: mqtt.Client, ud: Any, flags: Any, rc: Any, props: Any) -> None:
        self._connected.clear()
        if not self._stop.is_set():
            log.warning("disconnected from %s:%s: %s", self.s.host, self.s.port, rc)

    def _message(self, c: mqtt.Client, ud: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            p = msg.properties
            self._on_inbound(Inbound(
                msg.topic, bytes(msg.payload),
                getattr(p, "ResponseTopic", None) if p else None,
                getattr(p, "CorrelationData", None) if p else None,
            ))
        except Exception:
            log.exception("inbound message on %s not handled", msg.topic)

    def _published(self, c: mqtt.Client, ud: Any, mid: int, rc: Any, props: Any) -> None:
        # paho calls this holding its _out_message_mutex (PUBACK) or _in_callback_mutex (a
        # QoS 0 write, on the publishing thread): only hand the mid on, lock-free. _settle()
        # matches it to its row or waiter outside paho's locks.
        self._acks.put((mid, bool(rc is not None and getattr(rc, "is_failure", False))))

    def _settle(self) -> None:
        """Forget the outbox rows the broker acknowledged and wake publish_now's waiters
        (the MQTT thread, between two turns of the network loop)."""
        while True:
            try:
                mid, failed = self._acks.get_nowait()
            except queue.Empty:
                return
            with self._inflight_lock:
                what = self._inflight.pop(mid, None)
            if isinstance(what, threading.Event):
                what.set()
            elif what is not None:
                if failed:
                    log.error("broker refused outbox message %s (dropped)", what)
                self.outbox.done(what)

    # -- publishing ---------------------------------------------------------------------

    def flush(self) -> int:
        """Hand every outbox row this process has not handed yet to paho, in order. paho
        queues them while disconnected and sends them (and resends what was in flight) on
        the next CONNACK."""
        with self._pub_lock:
            rows = self.outbox.pending(after=self._handed_up_to)
            for m in rows:
                self._send(m)
                self._handed_up_to = m.rowid
            return len(rows)

    def _send(self, m: OutMessage) -> None:
        with self._inflight_lock:
            info = self.client.publish(m.topic, m.payload, qos=m.qos, retain=m.retain,
                                       properties=publish_props(m.props))
            if m.qos > 0:
                self._inflight[info.mid] = m.rowid
        if m.qos == 0:
            self.outbox.done(m.rowid)

    def publish_now(
        self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
        props: dict[str, Any] | None = None, wait_s: float = 0.0,
    ) -> bool:
        """Publish outside the outbox (status, telemetry). With ``wait_s`` wait for the PUBACK;
        returns whether it was acknowledged (QoS 0: whether it was sent while connected)."""
        if not self._connected.is_set() and qos == 0:
            return False
        acked = threading.Event()
        with self._inflight_lock:
            info = self.client.publish(topic, payload, qos=qos, retain=retain,
                                       properties=publish_props(props))
            if qos > 0 and wait_s > 0:
                self._inflight[info.mid] = acked
        if qos == 0 or wait_s <= 0:
            return info.rc == mqtt.MQTT_ERR_SUCCESS
        return acked.wait(wait_s)

    def subscribe(self, topics: list[str]) -> None:
        if topics:
            self.client.subscribe([(t, 1) for t in topics])

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s)

    # -- the connection loop ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mqtt", daemon=True)
        self._thread.start()

    def _connect_props(self) -> Properties:
        p = Properties(PacketTypes.CONNECT)
        p.SessionExpiryInterval = self.s.session_expiry_s
        p.MaximumPacketSize = MAX_INBOUND_PACKET_BYTES
        return p

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                will_topic, will_payload = self._before_connect()
                self.client.will_set(will_topic, will_payload, qos=1, retain=True)
                self.client.connect(self.s.host, self.s.port, keepalive=self.s.keepalive_s,
                                    clean_start=False, properties=self._connect_props())
                while not self._stop.is_set():
                    rc = self.client.loop(timeout=0.2)
                    self._settle()
                    if rc != mqtt.MQTT_ERR_SUCCESS:
                        break
            except Exception as e:  # refused, DNS, TLS handshake, reset: all mean "retry"
                log.warning("MQTT connection to %s:%s failed: %s", self.s.host, self.s.port, e)
            self._connected.clear()
            if self._stop.is_set():
                break
            # A connection that lived a while resets the back-off: this is a new outage.
            attempt = 0 if time.monotonic() - started > 30 else attempt + 1
            self._stop.wait(backoff_s(attempt, self.s.reconnect_min_s, self.s.reconnect_max_s,
                                      self._rng))

    def stop(self, final: tuple[str, bytes] | None = None, timeout_s: float = 5.0) -> None:
        """Publish ``final`` (the offline status, retained) and wait for its PUBACK, then
        disconnect cleanly (a normal DISCONNECT suppresses the last will)."""
        if (final is not None and self.connected and not self.publish_now(
                final[0], final[1], qos=1, retain=True, wait_s=timeout_s)):
            log.warning("offline status not acknowledged within %.1fs", timeout_s)
        self._stop.set()
        try:
            self.client.disconnect()
        except Exception as e:
            log.debug("disconnect: %s", e)
        if self._thread is not None:
            self._thread.join(timeout_s)
