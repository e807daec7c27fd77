"""The broker proves identity: attacks by device A, on its own account, against the mosquitto
that ``fleetctl broker-config`` provisions. Each test also shows the honest path still works
(an ACL that denies everything would pass the attack half alone)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from contract import Topics
from tests.security.conftest import SecureBroker
from tests.support.mqtt import Peer
from tests.support.pki import make_pki

T = Topics()
SESSION_S = 600


def _disconnects(peer: Peer) -> threading.Event:
    """Set when the broker drops ``peer`` (paho would silently reconnect it)."""
    gone = threading.Event()
    peer.client.on_disconnect = lambda *a: gone.set()
    return gone


def test_device_writes_only_its_own_topics(secure_broker: Callable[..., SecureBroker]) -> None:
    sb = secure_broker()
    a = sb.device("dev-a")
    watch = sb.operator("fleet-watch").subscribe(T.all_status(), T.all_results())
    try:
        for topic in (T.status("dev-b"), T.result("dev-b")):
            rc = a.publish(topic, b'{"forged": true}')
            assert rc is not None and rc.is_failure, (topic, rc)  # PUBACK: not authorized
        for topic in (T.command("dev-b", "deploy"), T.group_command("lab", "deploy")):
            rc = a.publish(topic, b'{"forged": true}')
            assert rc is not None and rc.is_failure, (topic, rc)
        rc = a.publish(T.result("dev-a"), b'{"own": true}')
        assert rc is not None and not rc.is_failure, rc
        watch.wait_for(lambda m: m.topic == T.result("dev-a"))
        assert not watch.matching(lambda m: "/dev-b/" in m.topic)
    finally:
        for p in (a, watch):
            p.close()


def test_device_reads_only_its_own_groups_commands(
    secure_broker: Callable[..., SecureBroker],
) -> None:
    sb = secure_broker()
    a, b = sb.device("dev-a"), sb.device("dev-b")
    send = sb.operator("fleet-send")
    try:
        # A asks for everything a device could want; the ACL decides what it gets.
        a.subscribe("fleet/v1/group/+/cmd/#", T.device_commands("dev-b"), "fleet/v1/#")
        b.subscribe(T.group_commands("lab"), T.group_commands("other"),
                    T.device_commands("dev-b"))
        for topic in (T.group_command("other", "ping"), T.command("dev-b", "ping"),
                      T.group_command("lab", "ping")):
            assert not send.publish(topic, b"{}").is_failure
        b.wait_for(lambda m: "/cmd/" in m.topic, count=3)
        # Delivery is in order: A's copy of the last (lab) command means the others were
        # never coming. (Overlapping subscriptions may deliver it twice.)
        a.wait_for(lambda m: m.topic == T.group_command("lab", "ping"))
        assert {m.topic for m in a.messages} == {T.group_command("lab", "ping")}
    finally:
        for p in (a, b, send):
            p.close()


def test_stolen_client_id_neither_kicks_the_owner_nor_wipes_its_session(
    secure_broker: Callable[..., SecureBroker],
) -> None:
    sb = secure_broker()
    send = sb.operator("fleet-send")
    b = sb.device("dev-b", session_expiry_s=SESSION_S).subscribe(T.device_commands("dev-b"))
    b_gone = _disconnects(b)
    try:
        # A logs in with its own password but B's client id, while B is online.
        thief = sb.device("dev-a", client_id="dev-b")
        send.publish(T.command("dev-b", "ping"), b'{"n": 1}')
        b.wait_for(lambda m: m.payload == b'{"n": 1}')
        assert not b_gone.is_set(), "B was kicked off by a client using its id"
        thief.close()
        # B goes offline keeping its session; a command waits there for it.
        b.close()
        send.publish(T.command("dev-b", "ping"), b'{"n": 2}')
        # A again as "dev-b", now with clean_start (which wipes the session it takes over).
        sb.device("dev-a", client_id="dev-b").close()
        b = sb.device("dev-b", session_expiry_s=SESSION_S)
        b.wait_for(lambda m: m.payload == b'{"n": 2}')
    finally:
        for p in (b, send):
            p.close()


def test_packet_over_max_packet_size_is_refused(
    secure_broker: Callable[..., SecureBroker],
) -> None:
    sb = secure_broker()
    conf = (sb.out / "mosquitto.conf").read_text().splitlines()
    limit = int(next(line.split()[1] for line in conf if line.startswith("max_packet_size ")))
    assert 64 * 1024 < limit <= 72 * 1024
    b = sb.device("dev-b").subscribe(T.device_commands("dev-b"))
    send = sb.operator("fleet-send")
    watch = sb.operator("fleet-watch").subscribe(T.all_results())
    try:
        # Commands: a 60 KiB one arrives; a 100 KiB one costs the sender its connection and
        # never reaches the device (which would otherwise buffer it whole).
        ok, big = b"x" * (60 * 1024), b"y" * (100 * 1024)
        assert not send.publish(T.command("dev-b", "ping"), ok).is_failure
        b.wait_for(lambda m: m.payload == ok)
        send_gone = _disconnects(send)
        send.publish(T.command("dev-b", "ping"), big, qos=0)  # QoS 0: paho will not resend it
        assert send_gone.wait(5), "the broker kept a client that sent an oversized packet"
        # Results: the same for a device.
        a = sb.device("dev-a")
        assert not a.publish(T.result("dev-a"), ok).is_failure
        watch.wait_for(lambda m: m.payload == ok)
        a_gone = _disconnects(a)
        a.publish(T.result("dev-a"), big, qos=0)
        assert a_gone.wait(5)
        time.sleep(0.5)
        assert not b.matching(lambda m: m.payload == big)
        assert not watch.matching(lambda m: m.payload == big)
        a.close()
    finally:
        for p in (b, send, watch):
            p.close()


def test_anonymous_and_misplaced_accounts_are_refused(
    secure_broker: Callable[..., SecureBroker],
) -> None:
    sb = secure_broker()
    with pytest.raises(ConnectionRefusedError):
        Peer(sb.devices)
    with pytest.raises(ConnectionRefusedError):
        Peer(sb.operators)
    with pytest.raises(ConnectionRefusedError):
        Peer(sb.devices, username="dev-a", password=sb.password("devices", "dev-b"))
    # A device account on the operator listener (where client ids are free) and an operator
    # account on the device listener: each password file holds only its own side.
    with pytest.raises(ConnectionRefusedError):
        Peer(sb.operators, username="dev-a", password=sb.password("devices", "dev-a"),
             client_id="dev-b")
    with pytest.raises(ConnectionRefusedError):
        Peer(sb.devices, username="fleet-send",
             password=sb.password("operators", "fleet-send"))
    # The honest logins, and operator tools on one account side by side (no kicking).
    a = sb.device("dev-a")
    sends = [sb.operator("fleet-send") for _ in range(2)]
    gone = [_disconnects(p) for p in sends]
    watch = sb.operator("fleet-watch")
    time.sleep(0.3)
    assert not any(g.is_set() for g in gone)
    for p in (a, *sends, watch):
        p.close()


def test_mutual_tls_binds_the_client_id_to_the_certificate(
    secure_broker: Callable[..., SecureBroker], tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path / "pki", ["dev-a", "dev-b"])
    sb = secure_broker("--require-certificate", tls=pki)
    assert not (sb.out / "passwd-devices").exists()
    send = sb.operator("fleet-send")
    b = sb.device("dev-b", session_expiry_s=SESSION_S).subscribe(T.device_commands("dev-b"))
    b_gone = _disconnects(b)
    a = sb.device("dev-a", client_id="dev-b")
    try:
        assert a.publish(T.result("dev-b"), b"{}").is_failure
        assert not a.publish(T.result("dev-a"), b"{}").is_failure
        send.publish(T.command("dev-b", "ping"), b'{"n": 1}')
        b.wait_for(lambda m: m.payload == b'{"n": 1}')
        assert not b_gone.is_set()
        with pytest.raises((ConnectionRefusedError, OSError)):
            Peer(sb.devices, username="dev-a", timeout_s=3)  # no certificate
    finally:
        for p in (a, b, send):
            p.close()
