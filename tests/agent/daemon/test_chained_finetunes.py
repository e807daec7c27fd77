"""Fine-tunes in a row, each from the model the one before committed, as an operator runs
them: every version has its own name, each result and event says what actually changed, and
the retained status follows the active model without a reconnect."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from agent.storage.slots import ModelSlots
from contract import TERMINAL_STATUSES, Topics
from tests.agent.daemon.conftest import AgentProc, command
from tests.support.device import ProvisionedDevice
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer

T = Topics()


def test_chained_finetunes_keep_distinct_names_and_the_status_follows(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc], device: ProvisionedDevice
) -> None:
    broker = mosquitto()
    fleet = Peer(broker).subscribe(T.status("dev-a"), T.result("dev-a"), T.all_events())
    a = agent(broker, **device.agent_config())
    first = fleet.wait_for(lambda m: m.topic == T.status("dev-a")
                           and m.json()["state"] == "online")[-1].json()
    assert first["model"]["version"] == "1"
    versions = ["1"]
    for _ in range(3):
        ft = command("finetune", args=device.finetune_args())
        fleet.publish(T.command("dev-a", "finetune"), ft)
        done = fleet.wait_for(lambda m, cid=ft["id"]: m.topic == T.result("dev-a")
                              and m.json()["id"] == cid
                              and m.json()["status"] in TERMINAL_STATUSES, timeout_s=180)
        res = done[-1].json()
        assert res["status"] == "SUCCEEDED", res
        out = res["result"]
        assert out["outcome"] == "committed"
        assert out["previous_model"]["version"] == versions[-1]
        assert out["model"]["version"] not in versions, (out, versions)
        versions.append(out["model"]["version"])
        # The retained status names the new version (same connection: no reconnect needed).
        st = fleet.wait_for(lambda m, v=versions[-1]: m.topic == T.status("dev-a")
                            and (m.json().get("model") or {}).get("version") == v)[-1].json()
        assert st["conn_seq"] == first["conn_seq"] and st["state"] == "online"
    events = [m.json() for m in fleet.wait_for(lambda m: "/evt/model_committed" in m.topic,
                                               count=3)]
    assert [(e["data"]["previous_model"]["version"], e["data"]["model"]["version"])
            for e in events] == list(itertools.pairwise(versions))
    # One lineage: every name starts from upstream release 1, sequences grow one by one.
    slots = ModelSlots(device.state, "digits")
    active = slots.active()
    assert active is not None and active.version == versions[-1]
    assert all(v.startswith("1+") for v in versions[1:])
    assert (active.manifest.sequence, active.manifest.base_release.version) == (4, "1")
    assert a.stop() == 0
    fleet.close()
