"""The operator's rollout controls through the real controller, a real mosquitto and simulated
devices: a rate that grows, an approval before each wave (kept across a controller restart),
devices that join the group during the rollout, and devices that defer a job while busy."""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contract import Topics
from fleet.mqtt import BrokerConfig, FleetConnection
from fleet.rollout.controller import Controller
from fleet.rollout.controls import next_rate, rate_limit
from fleet.rollout.plan import PlanError, RolloutPlan, validate_plan
from fleet.rollout.store import FleetStore
from fleet.sim.fleet import SimFleet
from tests.fleet.conftest import BOTH_ENGINES, fleetctl_argv
from tests.support.waiting import until

Run = Callable[..., subprocess.CompletedProcess[str]]

SPEED = 60.0
"""The in-process controller's clock runs this much faster than the wall: a minute of its
rate passes in a second, while the devices answer in real time."""


def _fast_clock() -> Callable[[], float]:
    t0 = time.time()
    return lambda: t0 + (time.time() - t0) * SPEED


def _report(tmp_path: Path, rid: str) -> dict[str, Any]:
    return json.loads((tmp_path / "reports" / f"{rid}.json").read_text())


# --- the rate ------------------------------------------------------------------------------


def test_rate_plan_fields_are_checked_and_the_rate_steps_once_a_minute() -> None:
    base = {"name": "r", "group": "g", "job": "deploy"}
    p = validate_plan({**base, "max_per_minute": "10/min", "rate_increase": 2,
                       "rate_increase_after": "succeeded:5", "max_rate": 30})
    assert p.max_per_minute == 10 and p.rate_trigger() == ("succeeded", 5)
    for bad, field in (({"rate_increase": 2}, "rate_increase_after"),
                       ({"rate_increase": 2, "rate_increase_after": "failed:3",
                         "max_per_minute": 5}, "rate_increase_after"),
                       ({"rate_increase": 9, "rate_increase_after": "notified:3",
                         "max_per_minute": 5}, "rate_increase"),
                       ({"max_rate": 5}, "max_rate"),
                       ({"follow_group": True, "group": None, "devices": ["d"]},
                        "follow_group")):
        with pytest.raises(PlanError, match=field):
            validate_plan({**base, **bad})
    c: dict[str, Any] = {}
    c.update(next_rate(p, c, {"notified": 0, "succeeded": 0}, 100.0) or {})
    assert rate_limit(p, c) == 10 and c["rate_at"] == 100.0
    counts = {"notified": 50, "succeeded": 9}
    assert next_rate(p, c, counts, 159.0) is None  # not a minute yet
    c.update(next_rate(p, c, counts, 161.0) or {})
    assert rate_limit(p, c) == 20 and c["rate_mark"] == 9
    assert next_rate(p, c, {"notified": 50, "succeeded": 13}, 300.0) is None  # 4 more < 5
    c.update(next_rate(p, c, {"notified": 50, "succeeded": 14}, 300.0) or {})
    assert rate_limit(p, c) == 30  # 40, held at max_rate
    assert next_rate(p, c, {"notified": 50, "succeeded": 99}, 999.0) is None


@pytest.mark.parametrize("trigger", ["notified:2", "succeeded:2"])
def test_rate_doubles_each_minute_its_trigger_is_met(
    sim_fleet: Callable[..., SimFleet], broker: BrokerConfig, tmp_path: Path, trigger: str,
) -> None:
    fleet = sim_fleet(devices=14, behavior={"job_duration_s": 0.02})
    store = FleetStore(tmp_path / "fleet.db")
    plan = RolloutPlan(name="rate", group="sim", job="deploy", args={"version": "v2"},
                       max_per_minute=2, rate_increase=2, rate_increase_after=trigger)
    rid = store.create_rollout(plan, sorted(fleet.devices)).id
    t = Topics(broker.prefix)
    conn = FleetConnection(broker, "rate-test", [t.all_results(), t.all_status()])
    conn.start()
    try:
        states = Controller(store, conn, clock=_fast_clock(), reask_s=1e6).run([rid])
    finally:
        conn.stop()
    assert states == {rid: "succeeded"}
    # Every batch goes out in one controller turn (one sent_at); a minute apart, each twice
    # the one before: 2, then 4 once 2 more were notified (succeeded), then 8.
    sent = sorted(e.sent_at for e in store.executions(rid) if e.sent_at is not None)
    batches = [n for _, n in sorted(Counter(sent).items())]
    assert batches == [2, 4, 8], batches
    starts = sorted(set(sent))
    assert all(b - a >= 60 for a, b in itertools.pairwise(starts))
    # The rate is in the db: a controller that takes the rollout over goes on at it.
    again = FleetStore(tmp_path / "fleet.db")
    r = again.rollout(rid)
    assert r is not None and rate_limit(r.plan, r.controls) == 8
    assert r.controls["rate_mark"] == 6  # notified (succeeded) when it last grew
    assert {d.model.version for d in fleet.devices.values()} == {"v2"}


# --- wave approval -------------------------------------------------------------------------


def _db_state(db: str, rid: str) -> tuple[str, list[str], int]:
    store = FleetStore(db)
    try:
        r = store.rollout(rid)
        assert r is not None
        sent = sum(e.sent_at is not None for e in store.executions(rid, "job"))
        return r.state, [w.state for w in store.waves(rid)], sent
    finally:
        store.close()


@BOTH_ENGINES
def test_approval_gate_holds_each_wave_across_a_restart_until_approved(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, broker: BrokerConfig, tmp_path: Path,
    subprocess_env: dict[str, str], fleet_db: str,
) -> None:
    fleet = sim_fleet(devices=4, behavior={"job_duration_s": 0.05})
    r = fleetctl("rollout", "create", "--detach", "--name", "gated", "--group", "sim",
                 "--job", "deploy", "--args", '{"version": "v2"}', "--waves", "1,50%,100%",
                 "--approve-waves")
    assert r.returncode == 0, r.stderr
    argv = [*fleetctl_argv(broker, tmp_path, fleet_db), "--lease-s", "1", "controller"]
    ctl = subprocess.Popen(argv, env=subprocess_env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        until(lambda: _db_state(fleet_db, "gated")[0] == "waiting_approval", 30,
              "waiting for the approval of wave 1")
        assert _db_state(fleet_db, "gated") == (
            "waiting_approval", ["done", "pending", "pending"], 1)
        st = fleetctl("rollout", "status", "gated")
        assert st.returncode == 0
        assert st.stdout.splitlines()[0] == \
            "rollout gated: waiting_approval (wave 1 waits: fleetctl rollout approve gated)"
        assert "approved through wave 0" in st.stdout
        ctl.kill()  # the controller dies while the rollout waits
        ctl.wait()
        ctl = subprocess.Popen(argv, env=subprocess_env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
        time.sleep(2.5)  # past the dead one's lease: the new controller drives it now
        assert _db_state(fleet_db, "gated") == (
            "waiting_approval", ["done", "pending", "pending"], 1)  # still held
        bad = fleetctl("rollout", "approve", "gated", "--wave", "3")
        assert bad.returncode == 2 and "has waves 0-2" in bad.stderr
        ok = fleetctl("rollout", "approve", "gated")
        assert ok.returncode == 0 and json.loads(ok.stdout)["wave"] == 1, ok.stderr
        until(lambda: _db_state(fleet_db, "gated")[1][1] == "done"
              and _db_state(fleet_db, "gated")[0] == "waiting_approval", 30,
              "wave 1 done, waiting for wave 2")
        assert _db_state(fleet_db, "gated")[2] == 2
        assert fleetctl("rollout", "approve", "gated", "--wave", "2").returncode == 0
        _, err = ctl.communicate(timeout=60)
    finally:
        ctl.kill()
    assert ctl.returncode == 0, err
    rep = _report(tmp_path, "gated")
    assert rep["state"] == "succeeded" and [w["state"] for w in rep["waves"]] == ["done"] * 3
    assert {d.model.version for d in fleet.devices.values()} == {"v2"}
    # A rollout without --approve-waves has nothing to approve.
    plain = fleetctl("rollout", "create", "--name", "plain", "--devices", "sim-0000",
                     "--job", "deploy", "--args", '{"version": "v3"}')
    assert plain.returncode == 0, plain.stderr
    r = fleetctl("rollout", "approve", "plain")
    assert r.returncode == 2 and "not created with --approve-waves" in r.stderr


# --- devices that join the group -----------------------------------------------------------


def _targets(db: str, rid: str) -> dict[str, int]:
    store = FleetStore(db)
    try:
        return dict(store.targets(rid))
    finally:
        store.close()


def test_follow_group_takes_devices_that_join_until_the_rollout_ends(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, broker: BrokerConfig, tmp_path: Path,
    subprocess_env: dict[str, str], fleet_db: str,
) -> None:
    fleet = sim_fleet(devices=3, behavior={"job_duration_s": 1.5})
    r = fleetctl("rollout", "create", "--detach", "--name", "dyn", "--group", "sim", "--job",
                 "deploy", "--args", '{"version": "v2"}', "--waves", "1,100%",
                 "--approve-waves", "--follow-group")
    assert r.returncode == 0, r.stderr
    ctl = subprocess.Popen([*fleetctl_argv(broker, tmp_path, fleet_db), "controller",
                            "--forever"], env=subprocess_env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    joiners: list[SimFleet] = []
    try:
        until(lambda: _db_state(fleet_db, "dyn")[0] == "waiting_approval", 30,
              "wave 0 done")
        # Joins before wave 1 started: it goes into wave 1 (the first one not started).
        joiners.append(sim_fleet(devices=1, first_index=3, behavior={"job_duration_s": 1.5}))
        until(lambda: _targets(fleet_db, "dyn").get("sim-0003") == 1, 30, "sim-0003 targeted")
        assert fleetctl("rollout", "approve", "dyn").returncode == 0
        until(lambda: _db_state(fleet_db, "dyn")[1] == ["done", "running"], 30,
              "wave 1 running")
        # Joins while the last wave runs: it goes into that wave, and runs now.
        joiners.append(sim_fleet(devices=1, first_index=4, behavior={"job_duration_s": 0.05}))
        until(lambda: _targets(fleet_db, "dyn").get("sim-0004") == 1, 30, "sim-0004 targeted")
        until(lambda: _db_state(fleet_db, "dyn")[0] == "succeeded", 60, "the rollout done")
        # Joins after the rollout finished: not taken (the controller is still running).
        joiners.append(sim_fleet(devices=1, first_index=5))
        until(lambda: joiners[-1].devices["sim-0005"].online, 10, "sim-0005 online")
        time.sleep(1.0)
        assert "sim-0005" not in _targets(fleet_db, "dyn")
    finally:
        ctl.terminate()
        ctl.wait(30)
    st = json.loads(fleetctl("rollout", "status", "dyn", "--json").stdout)
    assert st["targets"] == 5 and [w["devices"] for w in st["waves"]] == [1, 4]
    assert [w["succeeded"] for w in st["waves"]] == [1, 4]
    everyone = {**fleet.devices, **{d: x for j in joiners for d, x in j.devices.items()}}
    assert {d: x.model.version for d, x in everyone.items()} == {
        "sim-0000": "v2", "sim-0001": "v2", "sim-0002": "v2", "sim-0003": "v2",
        "sim-0004": "v2", "sim-0005": "v1"}
    assert everyone["sim-0005"].executed == []


# --- device-side deferral ------------------------------------------------------------------


@BOTH_ENGINES
def test_deferred_is_sent_again_without_a_failure_and_past_max_defers_fails(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, tmp_path: Path,
) -> None:
    fleet = sim_fleet(devices=3, behavior={"job_duration_s": 0.05},
                      overrides={"sim-0001": {"job_duration_s": 0.05, "defer": 2},
                                 "sim-0002": {"job_duration_s": 0.05, "defer": 5}})
    r = fleetctl("rollout", "create", "--name", "busy", "--group", "sim", "--job", "deploy",
                 "--args", '{"version": "v2"}', "--max-defers", "2", "--retries", "1",
                 "--abort-failure-rate", "1")
    assert r.returncode == 1, r.stdout + r.stderr  # one device failed for good
    rep = _report(tmp_path, "busy")
    jobs = {e["device"]: e for e in rep["executions"] if e["kind"] == "job"}
    assert len(rep["executions"]) == 3  # one attempt each: a deferral is no attempt
    assert (jobs["sim-0000"]["status"], jobs["sim-0000"]["defers"]) == ("SUCCEEDED", 0)
    assert (jobs["sim-0001"]["status"], jobs["sim-0001"]["defers"]) == ("SUCCEEDED", 2)
    assert jobs["sim-0002"]["status"] == "FAILED" and jobs["sim-0002"]["defers"] == 3
    assert jobs["sim-0002"]["error_code"] == "DEFERRED_TOO_OFTEN"
    assert jobs["sim-0002"]["error_message"].startswith(
        "the device deferred it 3 times (max_defers 2); last: simulated: a fine-tune job")
    key = rep["key"]
    # The same id each time: deferred twice, then run once; the other never ran.
    assert fleet.devices["sim-0001"].deferred == {f"{key}.sim-0001.1": 2}
    assert fleet.devices["sim-0001"].executed == [f"{key}.sim-0001.1"]
    assert fleet.devices["sim-0002"].deferred == {f"{key}.sim-0002.1": 3}
    assert fleet.devices["sim-0002"].executed == []
    assert rep["state"] == "completed_with_failures"
    assert [(f["device"], f["code"]) for f in rep["failures"]] \
        == [("sim-0002", "DEFERRED_TOO_OFTEN")]
