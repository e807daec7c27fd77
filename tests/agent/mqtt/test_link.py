"""The device's MQTT link against a real mosquitto: acknowledged outbox rows are forgotten,
and publishing from several threads while PUBACKs arrive never deadlocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.mqtt.link import LinkSettings, MqttLink
from agent.mqtt.outbox import Outbox
from tests.support.mosquitto import Broker


def _link(broker: Broker, state: Path) -> tuple[MqttLink, Outbox]:
    outbox = Outbox(state)
    link = MqttLink(
        LinkSettings(client_id="link-test", host=broker.host, port=broker.port,
                     username=broker.username, password=broker.password),
        outbox,
        before_connect=lambda: ("t/will", b"offline"),
        on_connected=lambda present: None,
        on_inbound=lambda m: None,
    )
    return link, outbox


def test_publishers_on_many_threads_and_pubacks_never_deadlock(
    mosquitto: Callable[..., Broker], tmp_path: Path
) -> None:
    """Four threads put rows and flush while a fifth waits for PUBACKs of its own messages.
    paho calls on_publish holding its message lock, and publish() takes that lock: a link
    that held its own lock across publish() and took it in on_publish hung here within a
    few hundred messages (the daemon then missed its keepalive and every later command)."""
    broker = mosquitto()
    link, outbox = _link(broker, tmp_path)
    link.start()
    assert link.wait_connected(10)
    errors: list[BaseException] = []

    def rows(n: int) -> None:
        try:
            for i in range(n):
                with outbox.tx() as tx:
                    tx.put(f"t/rows/{threading.get_ident()}", f"{i}".encode())
                link.flush()
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    acked: list[bool] = []

    def waiter(n: int) -> None:
        try:
            acked.extend(link.publish_now("t/now", b"x", qos=1, wait_s=10) for _ in range(n))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rows, args=(300,), daemon=True) for _ in range(4)]
    threads.append(threading.Thread(target=waiter, args=(200,), daemon=True))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    try:
        assert not any(t.is_alive() for t in threads), "publishers hung (deadlock)"
        assert not errors, errors
        assert acked == [True] * 200
        deadline = time.monotonic() + 10
        while outbox.count() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert outbox.count() == 0, f"{outbox.count()} acknowledged rows were not forgotten"
        assert link.connected
    finally:
        # A deadlocked link cannot be stopped either: do not let it hang the suite.
        stopper = threading.Thread(target=link.stop, daemon=True)
        stopper.start()
        stopper.join(10)


def test_rows_put_while_the_broker_is_down_are_sent_after_it_returns(
    mosquitto: Callable[..., Broker], tmp_path: Path
) -> None:
    broker = mosquitto()
    link, outbox = _link(broker, tmp_path)
    link.start()
    assert link.wait_connected(10)
    broker.stop()
    deadline = time.monotonic() + 10
    while link.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not link.connected
    for i in range(5):
        with outbox.tx() as tx:
            tx.put("t/offline", f"{i}".encode())
        link.flush()
    assert outbox.count() == 5
    broker.start()
    deadline = time.monotonic() + 30
    while outbox.count() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert outbox.count() == 0 and link.connected
    finally:
        link.stop()
        outbox.close()
