"""The broker proves identity: attacks by device A, by operator accounts and by a region's
bridge account, each on its own credentials, against the mosquitto brokers that ``fleetctl
broker-config`` provisions. Each test also shows the honest path still works (an ACL that
denies everything would pass the attack half alone)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contract import Topics
from fleet.inventory import Inventory, discover
from fleet.mqtt import SESSION_TAKEN_OVER, BrokerConfig, FleetConnection
from tests.security.conftest import FakeDevice, SecureBroker
from tests.support.broker_tier import Tier, tier  # noqa: F401 (fixture)
from tests.support.mqtt import Peer
from tests.support.pki import make_pki

T = Topics()
SESSION_S = 600


def _disconnects(peer: Peer) -> threading.Event:
    """Set when the broker drops ``peer`` (paho would silently reconnect it)."""
    gone = threading.Event()
    peer.client.on_disconnect = lambda *a: gone.set()
    return gone


def _disconnect_reasons(peer: Peer) -> list[Any]:
    """The reason code of each DISCONNECT the broker sends ``peer``, as they come."""
    reasons: list[Any] = []
    peer.client.on_disconnect = lambda c, ud, flags, rc, props: reasons.append(rc)
    return reasons


def _wait(pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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
    # The honest logins.
    a = sb.device("dev-a")
    watch = sb.operator("fleet-watch")
    a.close()
    watch.close()


def test_operator_tools_side_by_side_each_on_an_account_of_its_own(
    secure_broker: Callable[..., SecureBroker],
) -> None:
    """Client ids are bound to accounts on the operator listener too: two tools of one role
    side by side, each on its own account (``--operator NAME=ROLE``), never kick each other;
    a second login with one account replaces the first, whatever client id either sent."""
    sb = secure_broker("--operator", "fleet-send-2=fleet-send")
    sends = [sb.operator("fleet-send", client_id="fleetctl-send-1"),
             sb.operator("fleet-send-2", client_id="fleetctl-send-1")]
    reasons = [_disconnect_reasons(p) for p in sends]
    b = sb.device("dev-b").subscribe(T.device_commands("dev-b"))
    try:
        for i, p in enumerate(sends):
            assert not p.publish(T.command("dev-b", "ping"), {"n": i}).is_failure
        b.wait_for(lambda m: "/cmd/" in m.topic, count=2)
        time.sleep(0.3)
        assert reasons == [[], []]
        again = sb.operator("fleet-send", client_id="fleetctl-send-2")
        sends[0].client.reconnect_delay_set(60, 60)  # keep paho from taking it back at once
        assert _wait(lambda: bool(reasons[0])), "the first login with the account stayed"
        # mosquitto >= 2.0.15 says "Session taken over" (0x8E); 2.0.11 just drops it.
        assert reasons[1] == [] and reasons[0][0].value in (SESSION_TAKEN_OVER, 0x80)
        assert not again.publish(T.command("dev-b", "ping"), {"n": 2}).is_failure
        b.wait_for(lambda m: "/cmd/" in m.topic, count=3)
        again.close()
    finally:
        for p in (*sends, b):
            p.close()


def test_an_operator_account_cannot_take_a_devices_or_the_controllers_session(
    secure_broker: Callable[..., SecureBroker],
) -> None:
    """The read-only watcher logs in with the client id of device B, then of the controller:
    the broker replaces the id it sent with its own account's (``use_username_as_clientid``
    on the operator listener), so neither loses its connection or what is queued for it.
    (Stock mosquitto 2.0 cannot refuse such a CONNECT while letting other ids through: it
    binds an id to an account only by replacing it, or one exact id per account.)"""
    sb = secure_broker()
    send = sb.operator("fleet-send")
    b = sb.device("dev-b", session_expiry_s=SESSION_S).subscribe(T.device_commands("dev-b"))
    b_gone = _disconnects(b)
    ctl = sb.operator("fleet-controller", client_id="fleetctl-0123456789ab",
                      session_expiry_s=SESSION_S).subscribe(T.all_results())
    ctl_gone = _disconnects(ctl)
    try:
        thieves = [sb.operator("fleet-watch", client_id=cid)
                   for cid in ("dev-b", "fleet-controller", "fleetctl-0123456789ab")]
        for t in thieves:
            t.close()
        send.publish(T.command("dev-b", "ping"), b'{"n": 1}')
        b.wait_for(lambda m: m.payload == b'{"n": 1}')
        a = sb.device("dev-a")
        assert not a.publish(T.result("dev-a"), b'{"r": 1}').is_failure
        ctl.wait_for(lambda m: m.payload == b'{"r": 1}')
        assert not b_gone.is_set(), "B was kicked off by the watcher using its id"
        assert not ctl_gone.is_set(), "the controller was kicked off by the watcher"
        # Both offline, keeping their sessions; a command and a result wait there.
        b.close()
        ctl.close()
        send.publish(T.command("dev-b", "ping"), b'{"n": 2}')
        assert not a.publish(T.result("dev-a"), b'{"r": 2}').is_failure
        # The watcher again with each id, now with clean_start (which wipes a session taken).
        for cid in ("dev-b", "fleet-controller", "fleetctl-0123456789ab"):
            sb.operator("fleet-watch", client_id=cid).close()
        b = sb.device("dev-b", session_expiry_s=SESSION_S)
        b.wait_for(lambda m: m.payload == b'{"n": 2}')
        ctl = sb.operator("fleet-controller", client_id="fleetctl-0123456789ab",
                          session_expiry_s=SESSION_S)
        ctl.wait_for(lambda m: m.payload == b'{"r": 2}')
        a.close()
    finally:
        for p in (b, ctl, send):
            p.close()


def test_a_bridge_account_writes_only_its_own_regions_devices(
    tier: Callable[..., Tier],  # noqa: F811
) -> None:
    """At the core of a bridged tier, region eu's bridge account (its password is in the
    region's conf: a taken regional broker has it) publishes region us's device messages: the
    core refuses each and its subscribers never see one; eu's own devices' pass. And an
    operator account on the core with the bridge's client id takes nothing from the bridge."""
    t = tier()
    watch = t.operator("fleet-watch").subscribe(
        T.all_status(), T.all_results(), T.all_telemetry(), T.all_events(),
        "$SYS/broker/connection/+/state")
    before = time.monotonic()
    thief = Peer(t.bridge_listener(), username="bridge-eu", client_id="bridge-eu",
                 password=t.password("bridges", "bridge-eu"))
    try:
        for topic in (T.status("us-1"), T.result("us-1"), T.telemetry("us-1"),
                      T.event("us-1", "model_committed")):
            rc = thief.publish(topic, {"forged": True})
            assert rc is not None and rc.is_failure, (topic, rc)  # PUBACK: not authorized
        for topic in (T.status("eu-2"), T.result("eu-1")):
            assert not thief.publish(topic, {"own": True}).is_failure, topic
        watch.wait_for(lambda m: m.topic == T.result("eu-1"))
        time.sleep(0.5)  # a forgery let through would have come by now
        assert not watch.matching(lambda m: "/us-1/" in m.topic)
        assert watch.matching(lambda m: m.topic == T.status("eu-2"))
    finally:
        thief.close()
    # The thief's login replaced the real bridge (its will said 0); once the bridge is back,
    # an operator on the core sends a CONNECT with its client id and the bridge stays: a
    # command crosses to eu-1 and no will comes.
    down = watch.wait_for(lambda m: m.topic.endswith("/bridge-eu/state") and m.payload == b"0"
                          and m.at >= before)
    t.wait_bridges(watch, "eu", since=down[-1].at, timeout_s=60)
    eu1 = t.device("eu-1").subscribe(T.device_commands("eu-1"))
    send = t.operator("fleet-send")
    try:
        time.sleep(0.5)
        mark = time.monotonic()
        t.operator("fleet-watch", client_id="bridge-eu").close()
        assert not send.publish(T.command("eu-1", "ping"), {"n": 1}).is_failure
        eu1.wait_for(lambda m: m.topic == T.command("eu-1", "ping"))
        assert not watch.matching(lambda m: m.topic.endswith("/bridge-eu/state")
                                  and m.payload == b"0" and m.at >= mark)
    finally:
        for p in (eu1, send, watch):
            p.close()


def test_a_forged_or_garbled_retained_status_never_ends_discovery_early(
    secure_broker: Callable[..., SecureBroker], caplog: pytest.LogCaptureFixture,
) -> None:
    """A retains a status on its own topic that names B; C retains bytes that are no status.
    Discovery drops both (logged) from the topic's identity, and keeps listening: B, whose
    status comes after them, is found."""
    sb = secure_broker(inventory={"dev-a": ["lab"], "dev-b": ["lab"], "dev-c": ["lab"]})
    a, c = FakeDevice(sb, "dev-a", ["lab"]), FakeDevice(sb, "dev-c", ["lab"])
    assert not a.announce("online", device="dev-b", conn_seq=10**6).is_failure
    assert not c.publish(T.status("dev-c"), b"\x00not a status", retain=True).is_failure
    cfg = BrokerConfig(port=sb.operators.port, username="fleet-watch",
                       password_file=sb.secrets / "operators" / "fleet-watch.password")

    def run_discovery(during: Callable[[], Any] | None = None) -> Inventory:
        conn = FleetConnection(cfg, "fleetctl-inv-test", [T.all_status()])
        conn.start()
        found: list[Inventory] = []
        th = threading.Thread(target=lambda: found.append(
            discover(conn, settle_s=3.0, max_s=30.0)))
        try:
            th.start()
            if during is not None:
                time.sleep(0.3)  # the forgeries (retained) are there first
                during()
            th.join(40)
        finally:
            conn.stop()
        assert found, "discovery never returned"
        return found[0]

    b = FakeDevice(sb, "dev-b", ["lab"])
    try:
        # B comes online while discovery runs: only the forgeries were there before it.
        # (fleetctl's log set-up, run in this process by the fixture, replaced the root
        # logger's handlers, caplog's among them.)
        logging.getLogger("fleet").addHandler(caplog.handler)
        try:
            inv = run_discovery(lambda: b.announce("online", conn_seq=1))
        finally:
            logging.getLogger("fleet").removeHandler(caplog.handler)
        assert set(inv.devices) == {"dev-b"}
        assert inv.devices["dev-b"].conn_seq == 1 and inv.devices["dev-b"].state == "online"
        assert any(getattr(r, "claimed_device", None) == "dev-b"
                   and getattr(r, "topic", None) == T.status("dev-a") for r in caplog.records)
        assert any(getattr(r, "topic", None) == T.status("dev-c") for r in caplog.records)
        # And with everything retained (B's status after the forgeries): B is there.
        inv = run_discovery()
        assert set(inv.devices) == {"dev-b"} and inv.devices["dev-b"].conn_seq == 1
    finally:
        for p in (a, b, c):
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
