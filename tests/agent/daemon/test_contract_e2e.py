"""The contract end to end: a real edge-agent, a real mosquitto, driven by paho and by the
mosquitto_pub/mosquitto_sub command-line clients."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable

import pytest

from contract import Result, Status, Topics
from tests.agent.daemon.conftest import AgentProc, command, expired_at
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer, Received

T = Topics()


def results(peer: Peer, cid: str) -> Callable[[Received], bool]:
    return lambda m: m.topic == T.result("dev-a") and m.json().get("id") == cid


def test_ping_status_duplicate_expired_rejected_over_paho(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc]
) -> None:
    broker = mosquitto()
    fleet = Peer(broker).subscribe(T.result("dev-a"), T.status("dev-a"), "replies/#")
    a = agent(broker, groups=["lab"])
    online = fleet.wait_for(lambda m: m.topic == T.status("dev-a")
                            and m.json()["state"] == "online")[-1]
    st = Status.from_payload(online.payload)
    assert online.retain or st.conn_seq >= 0
    assert st.device == "dev-a" and st.groups == ["lab"]

    ping = command("ping")
    fleet.publish(T.command("dev-a", "ping"), ping, response_topic="replies/x",
                  correlation=b"corr-1")
    got = fleet.wait_for(results(fleet, ping["id"]), count=2)
    assert [Result.from_payload(m.payload).status for m in got] == ["ACCEPTED", "SUCCEEDED"]
    # v5 request/response: the same results on the ResponseTopic, CorrelationData echoed.
    replies = fleet.wait_for(lambda m: m.topic == "replies/x", count=2)
    assert {m.correlation for m in replies} == {b"corr-1"}

    fleet.publish(T.command("dev-a", "ping"), ping)  # same id again
    dup = fleet.wait_for(results(fleet, ping["id"]), count=3)[-1].json()
    assert dup["status"] == "DUPLICATE" and dup["stored_status"] == "SUCCEEDED"

    status = command("status")
    fleet.publish(T.group_command("lab", "status"), status)
    done = fleet.wait_for(results(fleet, status["id"]), count=2)[-1].json()
    assert done["status"] == "SUCCEEDED" and done["result"]["device"] == "dev-a"

    old = command("ping", expires_at=expired_at())
    fleet.publish(T.command("dev-a", "ping"), old)
    exp = fleet.wait_for(results(fleet, old["id"]))[-1].json()
    assert exp["status"] == "EXPIRED" and exp["error"]["code"] == "EXPIRED"
    fleet.publish(T.command("dev-a", "ping"), old)
    assert fleet.wait_for(results(fleet, old["id"]), count=2)[-1].json()["stored_status"] == (
        "EXPIRED")

    bad = command("set_power_mode", args={"watts": 5})
    fleet.publish(T.command("dev-a", "set_power_mode"), bad)
    rej = fleet.wait_for(results(fleet, bad["id"]))[-1].json()
    assert rej["status"] == "REJECTED" and rej["error"]["code"] == "BAD_ARGS"
    assert "args.mode" in rej["error"]["message"]

    ft = command("finetune", args={"model": "digits"})  # no data: the spec names the field
    fleet.publish(T.command("dev-a", "finetune"), ft)
    rej = fleet.wait_for(results(fleet, ft["id"]))[-1].json()
    assert rej["status"] == "REJECTED" and "args.data" in rej["error"]["message"]

    cancel = command("cancel", args={"job_id": "nope"})
    fleet.publish(T.command("dev-a", "cancel"), cancel)
    c = fleet.wait_for(results(fleet, cancel["id"]), count=2)[-1].json()
    assert c["status"] == "FAILED" and c["error"]["code"] == "NOT_FOUND"

    # seq orders every result of this device, with no gaps or repeats.
    seqs = [m.json()["seq"] for m in fleet.matching(lambda m: m.topic == T.result("dev-a"))]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    assert a.stop() == 0
    off = fleet.wait_for(lambda m: m.topic == T.status("dev-a")
                         and m.json()["state"] == "offline")[-1].json()
    assert off["conn_seq"] == st.conn_seq
    fleet.close()


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto-clients missing")
def test_contract_with_mosquitto_clients(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc]
) -> None:
    broker = mosquitto()
    a = agent(broker)
    base = ["-h", broker.host, "-p", str(broker.port), "-V", "mqttv5",
            "-u", str(broker.username), "-P", str(broker.password)]
    # The retained status is there for a late subscriber.
    out = subprocess.run(["mosquitto_sub", *base, "-t", T.status("dev-a"), "-C", "1",
                          "-W", "10"], capture_output=True, text=True, timeout=15)
    assert json.loads(out.stdout)["state"] == "online"
    sub = subprocess.Popen(["mosquitto_sub", *base, "-t", T.result("dev-a"), "-q", "1",
                            "-C", "4", "-W", "20"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    ping, bad = command("ping"), command("ping")
    bad["v"] = 7
    for c in (ping, bad):
        subprocess.run(["mosquitto_pub", *base, "-q", "1", "-t", T.command("dev-a", "ping"),
                        "-m", json.dumps(c)], check=True, timeout=10)
    subprocess.run(["mosquitto_pub", *base, "-q", "1", "-t", T.command("dev-a", "ping"),
                    "-m", "not json"], check=True, timeout=10)
    stdout, _ = sub.communicate(timeout=25)
    got = [json.loads(line) for line in stdout.splitlines()]
    assert [(r["id"], r["status"]) for r in got[:2]] == [(ping["id"], "ACCEPTED"),
                                                         (ping["id"], "SUCCEEDED")]
    assert got[2]["status"] == "REJECTED" and got[2]["error"]["code"] == "UNSUPPORTED_VERSION"
    assert got[3]["status"] == "REJECTED" and got[3]["error"]["code"] == "BAD_JSON"
    assert got[3]["id"] == ""  # no readable id: answered with an empty one, nothing stored
    assert a.stop() == 0
