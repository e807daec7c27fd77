"""The daemon's own credentials against a locked-down mosquitto: a password file (username
defaults to the device id) and mutual TLS (its certificate's CN is its username), each with the
per-device ACL. A wrong password or a certificate from another CA never gets it online."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from contract import Topics
from tests.agent.daemon.conftest import AgentProc, command
from tests.support.mosquitto import ACL_FLEET, Broker
from tests.support.mqtt import Peer
from tests.support.pki import make_pki, make_rogue_client

T = Topics()


def _ping_round_trip(fleet: Peer) -> None:
    fleet.subscribe(T.status("dev-a"), T.result("dev-a"))
    fleet.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online")
    ping = command("ping")
    fleet.publish(T.command("dev-a", "ping"), ping)
    got = fleet.wait_for(lambda m: m.topic == T.result("dev-a")
                         and m.json()["id"] == ping["id"], count=2)
    assert [m.json()["status"] for m in got] == ["ACCEPTED", "SUCCEEDED"]


def _never_online(a: AgentProc, seconds: float = 2.0) -> None:
    time.sleep(seconds)
    st = a.socket_request({"op": "status"})[0]["status"]
    assert st["connected"] is False, st


def test_daemon_with_a_password_file(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc], tmp_path: Path
) -> None:
    pw = {"dev-a": "s3cret-a", "fleet": "pf"}
    broker = mosquitto(passwords=pw, acl=ACL_FLEET)
    secret = tmp_path / "dev-a.password"
    secret.write_text("s3cret-a\n")
    secret.chmod(0o600)
    a = agent(broker, mqtt={"password_file": str(secret)})
    fleet = Peer(broker, username="fleet", password="pf")
    _ping_round_trip(fleet)
    assert a.stop() == 0
    # The same daemon with a wrong password: refused, keeps retrying, never online.
    secret.write_text("wrong\n")
    b = agent(broker, mqtt={"password_file": str(secret)})
    _never_online(b)
    assert "refused" in b.log_text() or "not authorized" in b.log_text().lower()
    fleet.close()


def test_daemon_with_a_client_certificate(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc], tmp_path: Path
) -> None:
    pki = make_pki(tmp_path / "pki", ["dev-a", "fleet"])
    broker = mosquitto(tls=pki, require_certificate=True, use_identity_as_username=True,
                       acl=ACL_FLEET)
    cert, key = pki.client("dev-a")
    a = agent(broker, mqtt={"tls": {"ca": str(pki.ca_cert), "cert": str(cert),
                                    "key": str(key)}})
    fleet = Peer(broker, cert=pki.client("fleet"))
    _ping_round_trip(fleet)
    assert a.stop() == 0
    # A certificate for the same CN from another CA: the handshake fails, never online.
    rogue_cert, rogue_key = make_rogue_client(tmp_path, "dev-a")
    b = agent(broker, mqtt={"tls": {"ca": str(pki.ca_cert), "cert": str(rogue_cert),
                                    "key": str(rogue_key)}})
    _never_online(b)
    fleet.close()
