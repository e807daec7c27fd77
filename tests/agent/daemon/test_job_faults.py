"""Fault tests with the real device job: a real ``edge-agent``, the real worker
(``python -m agent.jobs.worker``: pull, fine-tune, stage, health, commit on the registry
fixtures' tiny MLP) and a real mosquitto.

- kill -9 of the daemon at 6 random points of one finetune job: each restart resumes it, it
  ends SUCCEEDED with exactly one terminal result; the retained status goes offline (the last
  will, same conn_seq) then online with a higher conn_seq; a command published while the
  daemon was down is executed after it returns.
- the broker stopped for 10 s in the middle of the job: the result still arrives.
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Callable

import pytest

from agent.jobs.store import JobStore
from contract import TERMINAL_STATUSES, Topics
from tests.agent.daemon.conftest import AgentProc, command
from tests.support.device import ProvisionedDevice
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer, Received
from tests.support.waiting import until

T = Topics()
pytestmark = pytest.mark.slow


def _res(cid: str) -> Callable[[Received], bool]:
    return lambda m: m.topic == T.result("dev-a") and m.json().get("id") == cid


def _step_running(store: JobStore, jid: str, name: str) -> bool:
    return any(s.name == name and s.status == "running" for s in store.steps(jid))


def _finetune_past(store: JobStore, jid: str, step: int, since: float) -> bool:
    """The fine-tune child of this attempt reported optimizer step >= ``step`` — or the
    fine-tune already finished: its progress is throttled, so a resumed run that covers the
    last steps inside one interval shows only its final step, which the job's next progress
    row replaces within milliseconds; the kill then lands just after the fine-tune."""
    rec = store.get(jid)
    p = (rec.progress if rec else None) or {}
    if rec is not None and rec.updated_at > since and p.get("stage") == "finetune" \
            and int(p.get("step") or 0) >= step:
        return True
    return any(s.name == "finetune" and s.status == "done" for s in store.steps(jid))


def test_kill9_at_random_points_of_a_finetune_job(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc], device: ProvisionedDevice
) -> None:
    seed = int(os.environ.get("EDGETRAIN_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    total = 40
    broker = mosquitto()
    fleet = Peer(broker).subscribe(T.status("dev-a"), T.result("dev-a"), T.all_events())
    a = agent(broker, **device.agent_config())
    store = JobStore(device.state)
    online = [m.json() for m in fleet.wait_for(
        lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online")]
    ft = command("finetune", args=device.finetune_args(steps=total, checkpoint_every=4))
    fleet.publish(T.command("dev-a", "finetune"), ft)
    fleet.wait_for(lambda m: _res(ft["id"])(m) and m.json()["status"] == "ACCEPTED")
    jid = ft["id"]

    # Six kill points, each at a random place inside a different part of the job.
    lo, hi = rng.randint(2, total // 3), rng.randint(total // 2, total - 8)
    first_s = rng.uniform(0.0, 1.5)
    points: list[tuple[str, Callable[[float], bool]]] = [
        ("start", lambda since: time.time() - since > first_s),
        (f"finetune step>={lo}", lambda since: _finetune_past(store, jid, lo, since)),
        (f"finetune step>={hi}", lambda since: _finetune_past(store, jid, hi, since)),
        ("stage", lambda since: _step_running(store, jid, "stage")),
        ("health", lambda since: _step_running(store, jid, "health")),
        ("stored terminal", lambda since: bool((rec := store.get(jid)) and rec.terminal)),
    ]
    pings = []
    for i, (name, reached) in enumerate(points):
        since = time.time()
        until(functools.partial(reached, since), 120, f"kill point {name} (seed {seed})",
              poll_s=0.02)
        if name in ("stage", "health"):
            time.sleep(rng.uniform(0.0, 1.0))
        a.kill9()
        will = fleet.wait_for(lambda m: m.topic == T.status("dev-a")
                              and m.json()["state"] == "offline", count=i + 1)[-1].json()
        assert will["conn_seq"] == online[-1]["conn_seq"], (name, seed)
        if i % 2 == 0:  # sent while the daemon is down: waits in its broker session
            pings.append(command("ping"))
            fleet.publish(T.command("dev-a", "ping"), pings[-1])
        a.start()
        # The new connection's online status (a commit also republishes the status, with the
        # model, on the connection that made it).
        online.append(fleet.wait_for(lambda m, w=will: m.topic == T.status("dev-a")
                                     and m.json()["state"] == "online"
                                     and m.json()["conn_seq"] > w["conn_seq"])[-1].json())
        assert online[-1]["conn_seq"] > will["conn_seq"], (name, seed)

    fleet.wait_for(lambda m: _res(jid)(m) and m.json()["status"] in TERMINAL_STATUSES,
                   timeout_s=120)
    for p in pings:
        got = fleet.wait_for(_res(p["id"]), count=2)
        assert [m.json()["status"] for m in got] == ["ACCEPTED", "SUCCEEDED"]
    time.sleep(0.5)  # a second terminal result would arrive by now
    mine = [m.json() for m in fleet.matching(_res(jid))]
    statuses = [r["status"] for r in mine]
    assert [s for s in statuses if s in TERMINAL_STATUSES] == ["SUCCEEDED"], (statuses, seed)
    assert statuses.count("ACCEPTED") == 1 and statuses[0] == "ACCEPTED", statuses
    assert mine[-1]["result"]["outcome"] == "committed"
    events = [m.json() for m in fleet.matching(lambda m: "/evt/" in m.topic)]
    assert [(e["kind"], e["data"]["job_id"]) for e in events] == [("model_committed", jid)]
    rec = store.get(jid)
    assert rec is not None and rec.state.value == "SUCCEEDED" and rec.attempt >= 3, rec
    done = [s.name for s in store.steps(jid) if s.status == "done"]
    assert done == ["pull", "finetune", "stage", "health", "commit"], done
    assert a.stop() == 0
    fleet.close()


def test_broker_down_10s_mid_job_the_result_still_arrives(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc], device: ProvisionedDevice
) -> None:
    broker = mosquitto(persistence=True)
    # A persistent session: what the daemon publishes while this peer reconnects is queued for
    # it. The daemon retries every 0.2-0.3 s, so it is back on the broker before the peer.
    fleet = Peer(broker, client_id="fleet-obs", session_expiry_s=600).subscribe(
        T.result("dev-a"), T.status("dev-a"))
    a = agent(broker, **device.agent_config(),
              mqtt={"reconnect_min_s": 0.2, "reconnect_max_s": 0.3})
    fleet.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online")
    store = JobStore(device.state)
    ft = command("finetune", args=device.finetune_args(steps=30, checkpoint_every=10))
    fleet.publish(T.command("dev-a", "finetune"), ft)
    fleet.wait_for(lambda m: _res(ft["id"])(m) and m.json()["status"] == "IN_PROGRESS",
                   timeout_s=30)
    until(lambda: _finetune_past(store, ft["id"], 1, 0), 60, "the fine-tune", poll_s=0.02)
    fleet.close()
    broker.stop()
    time.sleep(10)
    broker.start()
    fleet = Peer(broker, client_id="fleet-obs", session_expiry_s=600)
    end = fleet.wait_for(lambda m: _res(ft["id"])(m)
                         and m.json()["status"] in TERMINAL_STATUSES, timeout_s=90)[-1].json()
    assert end["status"] == "SUCCEEDED" and end["result"]["outcome"] == "committed", end
    rec = store.get(ft["id"])
    assert rec is not None and rec.attempt == 1  # the outage did not disturb the job
    assert a.stop() == 0
    fleet.close()
