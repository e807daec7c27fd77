"""Per-device isolation at the broker: password file + ACL pattern, and mutual TLS.

Device A must neither receive B's commands nor publish on B's topics; a client without a
certificate from the fleet's CA is refused. Certificates are made on the fly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from contract import Topics
from tests.support.mosquitto import ACL_FLEET, Broker
from tests.support.mqtt import Peer
from tests.support.pki import make_pki, make_rogue_client

T = Topics()
FLEET_ACL = ACL_FLEET


def _isolation(broker: Broker, peer: Callable[[str], Peer]) -> None:
    a, b, fleet = peer("dev-a"), peer("dev-b"), peer("fleet")
    try:
        a.subscribe(T.device_commands("dev-a"), T.device_commands("dev-b"), T.result("dev-b"))
        b.subscribe(T.device_commands("dev-b"))
        fleet.subscribe(T.all_results())
        # The fleet sends B a command: B gets it, A (subscribed to B's topic) does not.
        fleet.publish(T.command("dev-b", "ping"), b'{"x":1}')
        fleet.publish(T.command("dev-a", "ping"), b'{"x":2}')
        b.wait_for(lambda m: m.topic == T.command("dev-b", "ping"))
        a.wait_for(lambda m: m.topic == T.command("dev-a", "ping"))
        assert not a.matching(lambda m: "/dev-b/" in m.topic)
        # A publishes a forged result as B: refused with "not authorized", never delivered.
        rc = a.publish(T.result("dev-b"), b'{"forged":true}')
        assert rc is not None and rc.is_failure, rc
        rc = a.publish(T.result("dev-a"), b'{"own":true}')
        assert rc is not None and not rc.is_failure, rc
        fleet.wait_for(lambda m: m.topic == T.result("dev-a"))
        assert not fleet.matching(lambda m: m.topic == T.result("dev-b"))
    finally:
        for p in (a, b, fleet):
            p.close()


def test_password_acl_isolates_devices(mosquitto: Callable[..., Broker]) -> None:
    pw = {"dev-a": "pa", "dev-b": "pb", "fleet": "pf"}
    broker = mosquitto(passwords=pw, acl=FLEET_ACL)
    _isolation(broker, lambda u: Peer(broker, username=u, password=pw[u]))
    with pytest.raises(ConnectionRefusedError):
        Peer(broker, username="dev-a", password="wrong")
    with pytest.raises(ConnectionRefusedError):
        Peer(broker)  # anonymous


def test_mtls_identity_acl_and_refusals(mosquitto: Callable[..., Broker], tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", ["dev-a", "dev-b", "fleet"])
    broker = mosquitto(tls=pki, require_certificate=True, use_identity_as_username=True,
                       acl=FLEET_ACL)
    _isolation(broker, lambda cn: Peer(broker, cert=pki.client(cn)))
    # No certificate, or one from another CA: the TLS handshake fails.
    for cert in (None, make_rogue_client(tmp_path, "dev-a")):
        with pytest.raises((ConnectionRefusedError, OSError)):
            Peer(broker, cert=cert, timeout_s=3)
