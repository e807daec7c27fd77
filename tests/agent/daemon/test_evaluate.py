"""The ``evaluate`` job through a real daemon and broker: a registry version scored on the
device's held-out data beside a baseline, never installed (fleet learning's federated
evaluation)."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.storage.slots import ModelSlots
from contract import TERMINAL_STATUSES, Topics
from tests.agent.daemon.conftest import AgentProc, command
from tests.support.device import ProvisionedDevice
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer
from tests.support.registry_fixtures import KeyPair, Publisher, _build_test_model

T = Topics()


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _run(fleet: Peer, args: dict[str, Any]) -> dict[str, Any]:
    cmd = command("evaluate", args=args)
    fleet.publish(T.command("dev-a", "evaluate"), cmd)
    done = fleet.wait_for(lambda m: m.topic == T.result("dev-a") and m.json()["id"] == cmd["id"]
                          and m.json()["status"] in TERMINAL_STATUSES, timeout_s=120)
    return done[-1].json()


def test_evaluate_scores_a_candidate_beside_a_baseline_without_installing_it(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc],
    device: ProvisionedDevice, upstream_key: KeyPair, tmp_path: Path,
) -> None:
    registry = tmp_path / "registry"
    shutil.copytree(device.registry, registry)
    pub = Publisher(registry, tmp_path / "ck", upstream_key)
    pub.publish(_build_test_model(0), "2", parent="1")  # v1's very weights
    pub.publish(_build_test_model(7), "3", parent="1")  # other weights
    # v3 with the device's own head (v1's): what scoring v3 personalized must equal
    from agent.finetune.personal import personalize

    mixed = _build_test_model(7)
    assert personalize(mixed, _build_test_model(0), ["head"]) > 0
    pub.publish(mixed, "4", parent="1")
    broker = mosquitto()
    fleet = Peer(broker).subscribe(T.status("dev-a"), T.result("dev-a"))
    a = agent(broker, **{**device.agent_config(), "registry": {"url": str(registry)}})
    fleet.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online")
    models = device.state / "models"
    before = _digest(models)

    same = _run(fleet, {"model": "digits", "version": "2", "data": device.data.name})
    assert same["status"] == "SUCCEEDED", same
    out = same["result"]
    ev = out["evaluation"]
    assert out["outcome"] == "unchanged" and out["model"]["version"] == "1", out
    assert ev["version"] == "2" and ev["baseline"]["version"] == "1", ev
    assert ev["samples"] > 0 and 0 <= ev["accuracy"] <= 1 and ev["candidate"]["finite"]
    # The same weights score the same on the same samples: both really ran on them.
    assert ev["accuracy"] == ev["baseline"]["accuracy"] and ev["gain_pts"] == 0, ev
    assert out["metrics_before"] == {"eval/acc": ev["baseline"]["accuracy"]}
    assert out["metrics_after"] == {"eval/acc": ev["accuracy"]}

    # A baseline named by version, a sample cap; the candidate's weights differ.
    other = _run(fleet, {"model": "digits", "version": "3", "data": device.data.name,
                         "evaluate": {"baseline": "1", "samples": 50}})
    assert other["status"] == "SUCCEEDED", other
    ev3 = other["result"]["evaluation"]
    assert ev3["samples"] == 50 and ev3["baseline"]["version"] == "1", ev3
    assert ev3["gain_pts"] == round(100 * (ev3["accuracy"] - ev3["baseline"]["accuracy"]), 3)
    full = _run(fleet, {"model": "digits", "version": "3", "data": device.data.name,
                        "evaluate": {"baseline": "1"}})
    ev3_full = full["result"]["evaluation"]
    assert "personalized" not in ev3_full  # not asked for

    # Personalized: v3 with this device's own head (its active v1's), scored on the same
    # samples; it equals v4 (those very tensors, published) scored plain.
    pers = _run(fleet, {"model": "digits", "version": "3", "data": device.data.name,
                        "evaluate": {"baseline": "1", "personal": ["head"]}})
    assert pers["status"] == "SUCCEEDED", pers
    evp = pers["result"]["evaluation"]
    p = evp["personalized"]
    from agent.finetune.personal import personal_keys

    head = personal_keys(_build_test_model(0), ["head"])
    assert p["parts"] == ["head"] and p["tensors"] == len(head) and p["own_version"] == "1", p
    assert evp["accuracy"] == ev3_full["accuracy"]  # the plain score is unchanged by it
    four = _run(fleet, {"model": "digits", "version": "4", "data": device.data.name})
    assert four["status"] == "SUCCEEDED", four
    assert p["accuracy"] == four["result"]["evaluation"]["accuracy"], (p, four)
    # (tests/agent/finetune/test_personal.py: exactly those tensors are swapped, no other)

    # Nothing was installed: the models folder is byte for byte the one before.
    assert _digest(models) == before
    slots = ModelSlots(device.state, "digits")
    assert [s.version for s in (slots.active(), slots.standby()) if s] == ["1"]

    # A version the registry does not have fails the job; a path for data is refused.
    missing = _run(fleet, {"model": "digits", "version": "9", "data": device.data.name})
    assert missing["status"] == "FAILED", missing
    bad = _run(fleet, {"model": "digits", "version": "2", "data": "../etc"})
    assert bad["status"] == "REJECTED" and "data" in bad["error"]["message"], bad
    assert _digest(models) == before
    assert a.stop() == 0
    fleet.close()
