"""A busy device defers a deploy (Greengrass' DeferComponentUpdate): the real ``edge-agent``
answers DEFERRED with its recheck time while a fine-tune runs, keeps no record of it, and
takes the same id once the fine-tune is over; and when it defers at all."""

from __future__ import annotations

from collections.abc import Callable

from agent.daemon.deferral import defer_reason
from agent.jobs.store import JobStore
from contract import TERMINAL_STATUSES, Result, Topics
from tests.agent.daemon.conftest import AgentProc, command
from tests.support.device import ProvisionedDevice
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer, Received

T = Topics()


def _res(cid: str) -> Callable[[Received], bool]:
    return lambda m: m.topic == T.result("dev-a") and m.json().get("id") == cid


def test_when_a_deploy_is_deferred() -> None:
    types = {"ft-1": "finetune", "dep-0": "deploy"}
    running_ft = {"id": "ft-1", "stage": "finetune"}
    assert defer_reason("deploy", "mqtt", running_ft, types.get) \
        == "a finetune job is running (ft-1)"
    hot = {"id": "dep-0", "stage": "stage",
           "detail": {"governor": "THROTTLED", "duty": 0.4, "limit": "thermal"}}
    assert defer_reason("deploy", "mqtt", hot, types.get) \
        == "the device is throttling: governor THROTTLED (thermal)"
    assert defer_reason("deploy", "mqtt", None, types.get) is None  # idle
    assert defer_reason("deploy", "mqtt", {"id": "dep-0", "stage": "pull"}, types.get) is None
    assert defer_reason("deploy", "socket", running_ft, types.get) is None  # a person asked
    assert defer_reason("finetune", "mqtt", running_ft, types.get) is None  # it queues


def test_real_daemon_defers_a_deploy_while_it_fine_tunes(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc], device: ProvisionedDevice
) -> None:
    broker = mosquitto()
    fleet = Peer(broker).subscribe(T.result("dev-a"), T.status("dev-a"))
    agent(broker, **device.agent_config(), limits={"defer_recheck_s": 7})
    fleet.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online",
                   timeout_s=30)  # subscribed to its commands
    store = JobStore(device.state)
    ft = command("finetune", args=device.finetune_args(steps=100_000))
    fleet.publish(T.command("dev-a", "finetune"), ft)
    fleet.wait_for(lambda m: _res(ft["id"])(m) and m.json()["status"] == "IN_PROGRESS",
                   timeout_s=60)
    dep = command("deploy", args={"model": "digits", "version": "1"})
    fleet.publish(T.command("dev-a", "deploy"), dep)
    got = Result.model_validate(fleet.wait_for(_res(dep["id"]), timeout_s=30)[0].json())
    assert got.status == "DEFERRED" and got.recheck_after_s == 7.0
    assert got.error is not None and got.error.code == "UNAVAILABLE"
    assert got.error.message == f"a finetune job is running ({ft['id']})"
    assert store.get(dep["id"]) is None  # no record: a repeat is a new delivery
    # The fine-tune ends (canceled); the same id sent again is taken, not a DUPLICATE.
    fleet.publish(T.command("dev-a", "cancel"), command("cancel", args={"job_id": ft["id"]}))
    fleet.wait_for(lambda m: _res(ft["id"])(m) and m.json()["status"] in TERMINAL_STATUSES,
                   timeout_s=60)
    fleet.publish(T.command("dev-a", "deploy"), dep)
    fleet.wait_for(lambda m: _res(dep["id"])(m) and m.json()["status"] in TERMINAL_STATUSES,
                   timeout_s=60)
    statuses = [m.json()["status"] for m in fleet.matching(_res(dep["id"]))]
    assert statuses[0] == "DEFERRED" and statuses[1] == "ACCEPTED", statuses
    assert "DUPLICATE" not in statuses and statuses.count("DEFERRED") == 1
    rec = store.get(dep["id"])
    assert rec is not None and rec.terminal
    fleet.close()
