"""A device that speaks for another: device A, on its own account and its own topics (all the
broker lets it write), publishes statuses, events and results that name device B. The fleet
takes the sender from the topic, so ``fleetctl devices``, ``watch``, ``send --wait`` and a
rollout ignore every one of them, and still believe what B itself says."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract import Command, Event, JobOutcome, Result, Topics, utc_now
from tests.security.conftest import Behaviour, FakeDevice, SecureBroker, run_fleetctl

T = Topics()


def _warned(stderr: str, claimed: str) -> bool:
    """fleetctl logged (JSON lines) that it dropped a message claiming ``claimed``."""
    for line in stderr.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("claimed_device") == claimed and rec.get("topic", "").startswith(
            "fleet/v1/dev/dev-a/"
        ):
            return True
    return False


def _outcome(outcome: str, before: float, after: float) -> dict[str, Any]:
    return JobOutcome(outcome=outcome, metrics_before={"eval/acc": before},  # type: ignore[arg-type]
                      metrics_after={"eval/acc": after}).model_dump(mode="json")


def test_forged_status_and_events_are_not_shown(
    secure_broker: Callable[..., SecureBroker], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    sb = secure_broker()
    b = FakeDevice(sb, "dev-b", ["lab", "other"])
    b.announce("offline", conn_seq=1)
    a = FakeDevice(sb, "dev-a", ["lab"])
    # A's own retained status, naming B, online, with a conn_seq far past B's.
    assert not a.announce("online", device="dev-b", conn_seq=10**6).is_failure
    r = run_fleetctl(sb, "fleet-watch", tmp_path, subprocess_env, "devices", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["device"]: row for row in json.loads(r.stdout)}
    assert rows["dev-b"]["state"] == "offline" and rows["dev-b"]["conn_seq"] == 1
    assert "dev-a" not in rows  # its only status names someone else
    assert _warned(r.stderr, "dev-b"), r.stderr

    # watch: the retained forgery, then a forged and an honest event naming B.
    argv = sb.fleetctl_argv("fleet-watch", tmp_path)
    watch = subprocess.Popen(
        [*argv, "watch", "--count", "2", "--duration-s", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env)
    try:
        assert watch.stdout is not None
        first = json.loads(watch.stdout.readline())  # subscribed: retained statuses came
        forged = Event(device="dev-b", kind="model_committed", seq=0, ts=utc_now(),
                       data={"forged": True})
        honest = Event(device="dev-b", kind="model_committed", seq=0, ts=utc_now(),
                       data={"honest": True})
        assert not a.publish(T.event("dev-a", "model_committed"), forged.to_payload()).is_failure
        assert not b.publish(T.event("dev-b", "model_committed"), honest.to_payload()).is_failure
        out, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    lines = [first] + [json.loads(x) for x in out.splitlines()]
    assert [(x["device"], x.get("state"), x.get("data")) for x in lines] == [
        ("dev-b", "offline", None), ("dev-b", None, {"honest": True})]
    assert _warned(err, "dev-b"), err

    # B's own word still counts.
    assert not b.announce("online", conn_seq=2).is_failure
    assert not a.announce("online").is_failure
    r = run_fleetctl(sb, "fleet-watch", tmp_path, subprocess_env, "devices", "--json")
    rows = {row["device"]: row for row in json.loads(r.stdout)}
    assert (rows["dev-a"]["state"], rows["dev-b"]["state"]) == ("online", "online")
    for p in (a, b):
        p.close()


def test_send_wait_counts_only_each_devices_own_results(
    secure_broker: Callable[..., SecureBroker], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    sb = secure_broker()

    def answer_for_b_too(dev: FakeDevice, cmd: Command) -> list[Result]:
        return [dev.result(cmd.id, "SUCCEEDED"),
                dev.result(cmd.id, "SUCCEEDED", device="dev-b")]

    # B is offline (its session keeps the group command for later); A answers for both.
    b = FakeDevice(sb, "dev-b", ["lab", "other"], session_expiry_s=600)
    b.announce("offline")
    b.close()
    a = FakeDevice(sb, "dev-a", ["lab"], Behaviour(answer_for_b_too))
    a.announce()
    send = ("send", "--group", "lab", "ping", "--wait", "--timeout-s", "3", "--json")
    r = run_fleetctl(sb, "fleet-send", tmp_path, subprocess_env, *send)
    rows = {x["device"]: x["status"] for x in json.loads(r.stdout)["results"]}
    assert rows == {"dev-a": "SUCCEEDED", "dev-b": "NO_REPLY"}, r.stdout
    assert r.returncode == 1
    assert _warned(r.stderr, "dev-b"), r.stderr

    # B back online answers for itself (the queued command first), and that counts.
    b = FakeDevice(sb, "dev-b", ["lab", "other"], session_expiry_s=600)
    b.announce()
    r = run_fleetctl(sb, "fleet-send", tmp_path, subprocess_env, *send)
    rows = {x["device"]: x["status"] for x in json.loads(r.stdout)["results"]}
    assert rows == {"dev-a": "SUCCEEDED", "dev-b": "SUCCEEDED"}, r.stdout + r.stderr
    assert r.returncode == 0
    assert len(b.commands) == 2
    for p in (a, b):
        p.close()


def test_rollout_records_only_what_each_device_said(
    secure_broker: Callable[..., SecureBroker], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    sb = secure_broker()

    def commit_and_speak_for_b(dev: FakeDevice, cmd: Command) -> list[Result]:
        # Execution ids are {rollout}-{nonce}.{device}.{attempt}: B's is A's, renamed.
        victim = cmd.id.replace(".dev-a.", ".dev-b.")
        return [dev.result(cmd.id, "ACCEPTED"),
                dev.result(cmd.id, "SUCCEEDED", result=_outcome("committed", 0.5, 0.6)),
                dev.result(victim, "ACCEPTED", device="dev-b"),
                dev.result(victim, "SUCCEEDED", device="dev-b",
                           result=_outcome("committed", 0.5, 0.99))]

    def gates_refuse(dev: FakeDevice, cmd: Command) -> list[Result]:
        return [dev.result(cmd.id, "ACCEPTED"),
                dev.result(cmd.id, "SUCCEEDED", result=_outcome("rolled_back", 0.5, 0.4))]

    # B answers honestly, after A's forgery has arrived (the first terminal result sticks).
    b = FakeDevice(sb, "dev-b", ["lab", "other"], Behaviour(gates_refuse, delay_s=1.0))
    b.announce()
    a = FakeDevice(sb, "dev-a", ["lab"], Behaviour(commit_and_speak_for_b))
    a.announce()
    r = run_fleetctl(sb, "fleet-controller", tmp_path, subprocess_env, "rollout", "create",
                     "--name", "r1", "--group", "lab", "--job", "deploy", "--args",
                     '{"version": "v2"}', "--timeout-s", "30")
    rep = json.loads((tmp_path / "reports" / "r1.json").read_text())
    jobs = {e["device"]: e for e in rep["executions"] if e["kind"] == "job"}
    got = {d: (e["status"], e["outcome"], e["metric_after"]) for d, e in jobs.items()}
    assert got == {"dev-a": ("SUCCEEDED", "committed", 0.6),
                   "dev-b": ("SUCCEEDED", "rolled_back", 0.4)}, got
    assert r.returncode == 1  # B's gates refused the model: a failed device
    assert _warned(r.stderr, "dev-b"), r.stdout + r.stderr
    for p in (a, b):
        p.close()


def test_groups_come_from_the_operators_inventory_not_the_status(
    secure_broker: Callable[..., SecureBroker], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    """A claims, in its own status, to be in group ``other`` (the inventory puts only B
    there). Without ``--inventory`` fleetctl can only believe the claim; with the inventory
    the broker was provisioned from, A is in no group it was not given: ``send --group other``
    never reaches A, and ``devices`` shows the inventory's groups."""
    sb = secure_broker()
    inventory = sb.out.parent / "inventory.yaml"
    b = FakeDevice(sb, "dev-b", ["lab", "other"])
    b.announce()
    a = FakeDevice(sb, "dev-a", ["lab"])
    assert not a.announce(groups=["lab", "other"]).is_failure

    r = run_fleetctl(sb, "fleet-watch", tmp_path, subprocess_env, "devices", "--json")
    claimed = {row["device"]: row["groups"] for row in json.loads(r.stdout)}
    assert claimed["dev-a"] == ["lab", "other"]  # what A says, all there is without one

    r = run_fleetctl(sb, "fleet-watch", tmp_path, subprocess_env, "--inventory",
                     str(inventory), "devices", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["device"]: row["groups"] for row in json.loads(r.stdout)}
    assert rows == {"dev-a": ["lab"], "dev-b": ["lab", "other"]}
    assert any(json.loads(x).get("claimed_groups") == ["lab", "other"]
               for x in r.stderr.splitlines() if x.startswith("{")), r.stderr

    r = run_fleetctl(sb, "fleet-send", tmp_path, subprocess_env, "--inventory", str(inventory),
                     "send", "--group", "other", "ping", "--wait", "--timeout-s", "5", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [x["device"] for x in json.loads(r.stdout)["results"]] == ["dev-b"]
    # The group command itself goes to the group topic, which A's ACL does not let it read.
    assert a.commands == [] and len(b.commands) == 1

    # A bad inventory is bad input, named: exit 2 before anything is sent.
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: {dev-a: {groops: [lab]}}\n")
    r = run_fleetctl(sb, "fleet-send", tmp_path, subprocess_env, "--inventory", str(bad),
                     "send", "--group", "other", "ping")
    assert r.returncode == 2 and "groops" in r.stderr, r.stderr
    for p in (a, b):
        p.close()
