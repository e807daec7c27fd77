"""A paho v5 test client that records what it receives: ``Peer(broker).subscribe(...)``.

Tests use it as "the fleet side": publish commands (with ResponseTopic/CorrelationData when
asked) and wait for the messages a device sends back.
"""

from __future__ import annotations

import itertools
import json
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

from tests.support.mosquitto import Broker

_ids = itertools.count()


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool
    qos: int
    correlation: bytes | None
    at: float
    expiry_s: int | None = None
    """The v5 Message Expiry Interval as the broker forwarded it (None: none set)."""

    def json(self) -> Any:
        return json.loads(self.payload)


class Peer:
    """Connected on construction; ``close()`` when done."""

    def __init__(
        self, broker: Broker, *, client_id: str | None = None, username: str | None = None,
        password: str | None = None, cert: tuple[Path, Path] | None = None,
        tls: bool | None = None, timeout_s: float = 10.0, session_expiry_s: int | None = None,
        anonymous: bool = False,
    ) -> None:
        """Without ``username`` or ``cert`` it logs in with the broker's test account, if it
        has one (``anonymous=True``: with no credentials, to see the broker refuse it).
        ``session_expiry_s``: a persistent session (clean_start=False): reconnecting with
        the same ``client_id`` gets what the broker queued for it meanwhile."""
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"peer-{next(_ids)}",
            protocol=mqtt.MQTTv5,
        )
        self.client.suppress_exceptions = True
        self.messages: list[Received] = []
        self.cond = threading.Condition()
        self.connect_rc: Any = None
        self.puback: dict[int, Any] = {}
        if username is None and cert is None and not anonymous and broker.username:
            username, password = broker.username, broker.password
        if username is not None:
            self.client.username_pw_set(username, password)
        if tls if tls is not None else broker.tls is not None:
            assert broker.tls is not None
            ctx = ssl.create_default_context(cafile=str(broker.tls.ca_cert))
            if cert is not None:
                ctx.load_cert_chain(str(cert[0]), str(cert[1]))
            self.client.tls_set_context(ctx)
        self.client.on_message = self._on_message
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        props = None
        if session_expiry_s:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = session_expiry_s
        self.client.connect(broker.host, broker.port, keepalive=30,
                            clean_start=not session_expiry_s, properties=props)
        self.client.loop_start()
        with self.cond:
            self.cond.wait_for(lambda: self.connect_rc is not None, timeout_s)
        if self.connect_rc is None or self.connect_rc.is_failure:
            self.close()
            raise ConnectionRefusedError(f"connect to {broker.port}: {self.connect_rc}")

    def _on_connect(self, c: Any, ud: Any, flags: Any, rc: Any, props: Any) -> None:
        with self.cond:
            self.connect_rc = rc
            self.cond.notify_all()

    def _on_publish(self, c: Any, ud: Any, mid: int, rc: Any, props: Any) -> None:
        with self.cond:
            self.puback[mid] = rc
            self.cond.notify_all()

    def _on_message(self, c: Any, ud: Any, msg: mqtt.MQTTMessage) -> None:
        corr = getattr(msg.properties, "CorrelationData", None) if msg.properties else None
        expiry = getattr(msg.properties, "MessageExpiryInterval", None) if msg.properties else None
        with self.cond:
            self.messages.append(Received(msg.topic, msg.payload, bool(msg.retain), msg.qos,
                                          corr, time.monotonic(), expiry))
            self.cond.notify_all()

    def subscribe(self, *topics: str, qos: int = 1, timeout_s: float = 5.0) -> Peer:
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        for t in topics:
            done.clear()
            self.client.subscribe(t, qos)
            done.wait(timeout_s)
        return self

    def publish(
        self, topic: str, payload: bytes | str | dict, *, qos: int = 1, retain: bool = False,
        response_topic: str | None = None, correlation: bytes | None = None,
        wait: bool = True,
    ) -> Any:
        """Publish; with ``wait`` return the PUBACK reason code (QoS 1)."""
        if isinstance(payload, dict):
            payload = json.dumps(payload)
        props = None
        if response_topic or correlation:
            props = Properties(PacketTypes.PUBLISH)
            if response_topic:
                props.ResponseTopic = response_topic
            if correlation:
                props.CorrelationData = correlation
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if wait and qos > 0:
            with self.cond:
                self.cond.wait_for(lambda: info.mid in self.puback, 10)
            return self.puback.get(info.mid)
        return None

    def wait_for(
        self, pred: Callable[[Received], bool], *, count: int = 1, timeout_s: float = 10.0
    ) -> list[Received]:
        """Wait until ``count`` received messages satisfy ``pred``; AssertionError otherwise."""
        with self.cond:
            ok = self.cond.wait_for(
                lambda: sum(1 for m in self.messages if pred(m)) >= count, timeout_s
            )
            got = [m for m in self.messages if pred(m)]
        if not ok:
            raise AssertionError(
                f"waited {timeout_s}s for {count} matching messages, got {len(got)}; last "
                f"received: {[(m.topic, m.payload[:200]) for m in self.messages[-5:]]}"
            )
        return got

    def matching(self, pred: Callable[[Received], bool]) -> list[Received]:
        with self.cond:
            return [m for m in self.messages if pred(m)]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
