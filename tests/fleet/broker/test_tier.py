"""The bridged broker tier (``fleetctl broker-config --core``) on real mosquitto processes: a
core and two regional brokers on loopback, started from exactly the files it writes; devices
on their regions, the fleet's tools on the core. (The files themselves, and what is refused,
are in test_config.py; the tier itself in tests/support/broker_tier.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contract import Topics
from fleet.mqtt import BrokerConfig
from fleet.sim.config import SimConfig
from fleet.sim.fleet import SimFleet
from tests.support.broker_tier import INVENTORY, Tier
from tests.support.mqtt import Peer, Received
from tests.support.pki import make_pki

T = Topics()
SESSION_S = 600


def settle(s: float = 0.5) -> None:
    """Time for a duplicate to arrive, if one were coming."""
    time.sleep(s)


def once(peer: Peer, topic: str, payload: bytes | None = None) -> list[Received]:
    got = peer.matching(lambda m: m.topic == topic and (payload is None or m.payload == payload))
    assert len(got) == 1, (topic, payload, [(m.topic, m.payload) for m in peer.messages])
    return got


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_commands_reach_either_region_and_results_reach_the_core_once(
    tier: Callable[..., Tier], tmp_path: Path, tls: bool,
) -> None:
    t = tier(tls=make_pki(tmp_path / "pki", []) if tls else None)
    ctl = t.operator("fleet-controller").subscribe(T.all_results(), T.all_status())
    eu, us = (t.device(d).subscribe(T.device_commands(d)) for d in ("eu-1", "us-1"))
    try:
        for dev in ("eu-1", "us-1"):
            assert not ctl.publish(T.command(dev, "ping"), {"to": dev}).is_failure
        eu.wait_for(lambda m: "/cmd/" in m.topic)
        us.wait_for(lambda m: "/cmd/" in m.topic)
        for dev, peer in (("eu-1", eu), ("us-1", us)):
            assert not peer.publish(T.result(dev), {"from": dev}).is_failure
            peer.publish(T.status(dev), {"state": "online"}, retain=True)
        ctl.wait_for(lambda m: m.topic.endswith("/res"), count=2)
        settle()
        once(eu, T.command("eu-1", "ping"))
        once(us, T.command("us-1", "ping"))
        assert [m.topic for m in eu.messages + us.messages] == [
            T.command("eu-1", "ping"), T.command("us-1", "ping")]  # not the other's
        for dev in ("eu-1", "us-1"):
            once(ctl, T.result(dev))
        # A retained status crosses as retained: a tool started later finds every device.
        late = t.operator("fleet-watch").subscribe(T.all_status())
        try:
            got = late.wait_for(lambda m: m.retain, count=2)
            assert sorted(m.topic for m in got) == [T.status("eu-1"), T.status("us-1")]
        finally:
            late.close()
    finally:
        for p in (ctl, eu, us):
            p.close()


def test_a_group_command_is_one_publish_at_the_core_and_reaches_each_member_once(
    tier: Callable[..., Tier],
) -> None:
    t = tier()
    send = t.operator("fleet-send")
    peers = {d: t.device(d).subscribe(T.device_commands(d), *[
        T.group_commands(g) for g in INVENTORY[d]["groups"]]) for d in INVENTORY}
    try:
        topic = T.group_command("line-3", "ping")
        assert not send.publish(topic, {"n": 1}).is_failure
        for d in ("eu-1", "us-1"):
            peers[d].wait_for(lambda m: m.topic == topic)
        settle()
        for d in ("eu-1", "us-1"):
            once(peers[d], topic)
        assert peers["eu-2"].messages == []  # not in line-3 (and its ACL would refuse it)
    finally:
        for p in (send, *peers.values()):
            p.close()


def test_a_region_split_over_bridges_delivers_each_message_once(
    tier: Callable[..., Tier],
) -> None:
    """Region eu with one device per bridge (``--devices-per-bridge 1``): two bridges. Each
    device's commands cross on its own bridge, a group command once (on the first), each
    device's results reach the core once, and neither bridge may write the other's device."""
    t = tier("--devices-per-bridge", "1")
    assert t.bridges == {"eu": ["bridge-eu", "bridge-eu@1"], "us": ["bridge-us"]}
    ctl = t.operator("fleet-controller").subscribe(T.all_results())
    peers = {d: t.device(d).subscribe(T.device_commands(d), *[
        T.group_commands(g) for g in INVENTORY[d]["groups"]]) for d in INVENTORY}
    try:
        for d in INVENTORY:
            assert not ctl.publish(T.command(d, "ping"), {"to": d}).is_failure
        send = t.operator("fleet-send")  # the role that sends group commands
        assert not send.publish(T.group_command("line-3", "ping"), {"g": 1}).is_failure
        for d in INVENTORY:
            peers[d].wait_for(lambda m, d=d: m.topic == T.command(d, "ping"))
            assert not peers[d].publish(T.result(d), {"from": d}).is_failure
        for d in ("eu-1", "us-1"):
            peers[d].wait_for(lambda m: m.topic == T.group_command("line-3", "ping"))
        ctl.wait_for(lambda m: m.topic.endswith("/res"), count=len(INVENTORY))
        settle()
        for d in INVENTORY:
            once(peers[d], T.command(d, "ping"))
            once(ctl, T.result(d))
        for d in ("eu-1", "us-1"):
            once(peers[d], T.group_command("line-3", "ping"))
        assert not peers["eu-2"].matching(lambda m: "/group/" in m.topic)
        send.close()
        # eu-2's bridge (its only device) may not write eu-1's topics at the core.
        thief = Peer(t.bridge_listener(), username="bridge-eu@1", client_id="bridge-eu@1",
                     password=t.password("bridges", "bridge-eu"))
        try:
            assert thief.publish(T.result("eu-1"), {"forged": True}).is_failure
            assert not thief.publish(T.result("eu-2"), {"own": True}).is_failure
        finally:
            thief.close()
    finally:
        for p in (ctl, *peers.values()):
            p.close()


def test_a_device_writes_only_its_own_topics_and_cannot_be_the_bridge(
    tier: Callable[..., Tier],
) -> None:
    t = tier()
    watch = t.operator("fleet-watch").subscribe(T.all_results(), T.all_status())
    eu1 = t.device("eu-1")
    try:
        # Another device's topics, in its own region and in the other: refused at the region.
        for topic in (T.result("eu-2"), T.result("us-1"), T.status("us-1"),
                      T.command("us-1", "deploy"), T.group_command("line-3", "deploy")):
            rc = eu1.publish(topic, {"forged": True})
            assert rc is not None and rc.is_failure, (topic, rc)
        assert not eu1.publish(T.result("eu-1"), {"own": True}).is_failure
        watch.wait_for(lambda m: m.topic == T.result("eu-1"))
        settle()
        assert [m.topic for m in watch.messages] == [T.result("eu-1")]
        # The bridge's account: not on the region's device listener, and a device's account
        # is not on the core's bridge listener.
        with pytest.raises(ConnectionRefusedError):
            Peer(t.regions["eu"], client_id="bridge-eu", username="bridge-eu",
                 password=t.password("bridges", "bridge-eu"))
        core_bridges = t.bridge_listener()
        with pytest.raises(ConnectionRefusedError):
            Peer(core_bridges, username="eu-1", password=t.password("devices", "eu-1"))
        # Even with the bridge's password (it is in the region's conf), the core lets it
        # write device messages but no command.
        thief = Peer(core_bridges, username="bridge-eu", client_id="bridge-eu",
                     password=t.password("bridges", "bridge-eu"))
        try:
            for topic in (T.command("us-1", "deploy"), T.group_command("line-3", "deploy")):
                rc = thief.publish(topic, {"forged": True})
                assert rc is not None and rc.is_failure, (topic, rc)
        finally:
            thief.close()
    finally:
        for p in (watch, eu1):
            p.close()


def test_queued_messages_survive_a_regional_kill_and_a_core_restart(
    tier: Callable[..., Tier],
) -> None:
    """Persistent sessions end to end: the controller's on the core (clean_start False and a
    session expiry, as fleet.mqtt's), a device's on its region, the bridge's on both."""
    t = tier()
    n = 20
    ctl = t.operator("fleet-controller", client_id="fleetctl-controller",
                     session_expiry_s=SESSION_S).subscribe(T.all_results())
    watch = t.operator("fleet-watch").subscribe("$SYS/broker/connection/+/state")
    dev = t.device("eu-1", session_expiry_s=SESSION_S).subscribe(T.device_commands("eu-1"))
    eu = t.regions["eu"]
    try:
        # The region dies without a word (its sessions were saved before: SIGUSR1 is the
        # autosave that a long-running broker has done long before a crash).
        assert eu.proc is not None
        eu.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
        eu.proc.kill()
        eu.proc.wait()
        watch.wait_for(lambda m: m.topic.endswith("/bridge-eu/state") and m.payload == b"0")
        # Commands sent meanwhile wait in the bridge's session on the core.
        for i in range(n):
            assert not ctl.publish(T.command("eu-1", "ping"), {"n": i}).is_failure
        back = time.monotonic()
        eu.start()
        t.wait_bridges(watch, "eu", since=back)
        got = dev.wait_for(lambda m: "/cmd/" in m.topic, count=n, timeout_s=20)
        assert [m.json()["n"] for m in got] == list(range(n))
        # Results sent while the core is down wait in the region's bridge session, and the
        # controller's session on the core (saved at SIGTERM) takes them when both are back.
        t.core.stop()
        for i in range(n):
            assert not dev.publish(T.result("eu-1"), {"n": i}).is_failure
        t.core.start()
        res = ctl.wait_for(lambda m: m.topic == T.result("eu-1"), count=n, timeout_s=40)
        settle()
        assert sorted(m.json()["n"] for m in ctl.matching(
            lambda m: m.topic == T.result("eu-1"))) == list(range(n))
        assert [m.json()["n"] for m in res] == list(range(n))
        assert len(dev.matching(lambda m: "/cmd/" in m.topic)) == n
        # And when the region restarts too while holding them (its persistence file).
        t.core.stop()
        for i in range(n, 2 * n):
            assert not dev.publish(T.result("eu-1"), {"n": i}).is_failure
        eu.stop()
        eu.start()
        t.core.start()
        ctl.wait_for(lambda m: m.topic == T.result("eu-1"), count=2 * n, timeout_s=40)
        settle()
        assert sorted(m.json()["n"] for m in ctl.matching(
            lambda m: m.topic == T.result("eu-1"))) == list(range(2 * n))
    finally:
        for p in (ctl, watch, dev):
            p.close()


def _sim_inventory(per_region: int) -> dict[str, dict[str, Any]]:
    ids = SimConfig(devices=2 * per_region).device_ids()
    return {d: {"groups": ["sim"], "region": "eu" if i < per_region else "us"}
            for i, d in enumerate(ids)}


def _fleetctl_argv(t: Tier, account: str, tmp_path: Path) -> list[str]:
    """The real fleetctl on the core's operator listener, logged in as ``account``, with
    the inventory the tier was provisioned from."""
    return [sys.executable, "-m", "fleet.cli", "--port", str(t.core.port), "--username",
            account, "--password-file", str(t.secrets / "operators" / f"{account}.password"),
            "--inventory", str(t.out.parent / "inventory.yaml"),
            "--db", str(tmp_path / "fleet.db"), "--report-dir", str(tmp_path / "reports"),
            "--settle-s", "0.5"]


def _fleetctl(t: Tier, account: str, tmp_path: Path, env: dict[str, str], *args: str,
              timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_fleetctl_argv(t, account, tmp_path) + list(args),
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_sim_processes_on_two_regions_answer_fleetctl_at_the_core(
    tier: Callable[..., Tier], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    """``python -m fleet.sim`` once per region, each with its own id range and each device on
    its own account; ``fleetctl send --group`` and ``devices`` at the core see them all."""
    inv = _sim_inventory(3)
    t = tier(inventory=inv)
    procs = []
    try:
        for first, region in ((0, "eu"), (3, "us")):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fleet.sim", "--port", str(t.regions[region].port),
                 "--password-dir", str(t.secrets / "devices"), "--devices", "3",
                 "--first-index", str(first), "--group", "sim", "--job-duration-s", "0.05"],
                env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert json.loads(line) == {"event": "sim_ready", "devices": 3}, p.stderr
        r = _fleetctl(t, "fleet-send", tmp_path, subprocess_env,
                      "send", "--group", "sim", "ping", "--wait", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        rows = json.loads(r.stdout)["results"]
        assert sorted(x["device"] for x in rows) == sorted(inv)
        assert {x["status"] for x in rows} == {"SUCCEEDED"}
        r = _fleetctl(t, "fleet-watch", tmp_path, subprocess_env, "devices", "--json")
        assert r.returncode == 0, r.stderr
        assert sorted(d["device"] for d in json.loads(r.stdout)) == sorted(inv)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(10)


def test_a_rollout_across_two_regions_survives_a_regional_restart(
    tier: Callable[..., Tier], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    """The real controller at the core, simulated devices in both regions; region us (the
    last wave's) restarts while its jobs run. Every device ends succeeded, none ran its job
    twice."""
    inv = _sim_inventory(5)
    t = tier(inventory=inv)
    fleets = [SimFleet(SimConfig.model_validate({
                           "devices": 5, "first_index": first, "groups": ["sim"],
                           "behavior": {"job_duration_s": 1.0}}),
                       BrokerConfig(port=t.regions[region].port),
                       password_dir=t.secrets / "devices").start()
              for first, region in ((0, "eu"), (5, "us"))]
    us_devices = fleets[1].devices.values()
    try:
        argv = ["rollout", "create", "--name", "tier", "--group", "sim", "--job", "deploy",
                "--args", '{"version": "v2"}', "--waves", "1,50%,100%", "--bake-s", "0.2"]
        proc = subprocess.Popen(
            _fleetctl_argv(t, "fleet-controller", tmp_path) + argv, env=subprocess_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while not any(d.executed for d in us_devices):  # the last wave has started
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        t.regions["us"].stop()
        time.sleep(1.0)  # the jobs end meanwhile: their results wait in the devices' clients
        t.regions["us"].start()
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out
        rep = json.loads((tmp_path / "reports" / "tier.json").read_text())
        assert rep["state"] == "succeeded", rep
        jobs = [e for e in rep["executions"] if e["kind"] == "job"]
        assert sorted(e["device"] for e in jobs) == sorted(inv)
        assert {e["status"] for e in jobs} == {"SUCCEEDED"}
        for f, region in zip(fleets, ("eu", "us"), strict=True):
            for d in f.devices.values():
                assert d.executed == [f"{rep['key']}.{d.id}.1"], (d.id, d.executed)
                assert d.model.version == "v2", (d.id, d.model)
                # A job message in flight when region us stopped may come again (QoS 1 is at
                # least once: seen in a run beside another test process); the device answers
                # it DUPLICATE and runs nothing (executed, above). Region eu never restarted.
                assert d.duplicates == 0 or region == "us", (d.id, region, d.duplicates)
    finally:
        for f in fleets:
            f.stop()
        for f in fleets:
            assert not f.errors, f.errors
