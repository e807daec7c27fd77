"""Controller replicas on one PostgreSQL db: leases, the inbox, and a replica SIGKILLed in
the middle of a rollout, on a real PostgreSQL and a real mosquitto."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from contract import Result
from fleet.db import Database
from fleet.rollout.plan import RolloutPlan
from fleet.rollout.replicas import INBOX_KEEP_S, Replica
from fleet.rollout.store import Execution, FleetStore
from fleet.sim.fleet import SimFleet
from tests.fleet.conftest import BOTH_ENGINES, fleetctl_argv
from tests.support.waiting import until

PG = pytest.mark.parametrize("fleet_db", ["postgresql"], indirect=True)


@PG
def test_a_lease_is_one_replicas_until_it_expires(fleet_db: str) -> None:
    store = FleetStore(fleet_db)
    a = Replica(store.db, "a", lease_s=0.6)
    b = Replica(Database(fleet_db), "b", lease_s=0.6)
    assert a.acquire("r1") and not b.acquire("r1")
    assert a.acquire("r1")  # renewing one's own lease
    assert b.acquire("r2") and not a.acquire("r2")
    time.sleep(0.7)  # a stalls past its lease: b takes r1, and a learns it lost it
    assert b.acquire("r1")
    assert a.renew(time.time()) == {"r1"} and a.held == set()
    b.release("r1")
    assert a.acquire("r1")
    store.close()


@PG
def test_the_inbox_keeps_results_of_known_executions_for_their_rollouts_holder(
    fleet_db: str,
) -> None:
    store = FleetStore(fleet_db)
    r = store.create_rollout(RolloutPlan(name="r", group="g", job="deploy"), ["d1", "d2"])
    other = store.create_rollout(RolloutPlan(name="o", group="g", job="deploy"), ["d1"])
    store.save_executions([Execution("r.d1.1", r.id, "d1", 0, "job", 1, "SENT", 1.0),
                           Execution("o.d1.1", other.id, "d1", 0, "job", 1, "SENT", 1.0)])
    rep = Replica(store.db, "receiver")
    for seq, (eid, status) in enumerate((("r.d1.1", "ACCEPTED"), ("r.d1.1", "SUCCEEDED"),
                                         ("o.d1.1", "FAILED"), ("nobody.d9.1", "SUCCEEDED"))):
        rep.defer("d1", Result(id=eid, status=status, device="d1", seq=seq,  # type: ignore[arg-type]
                               ts=datetime.now(timezone.utc)))
    rep.flush()
    holder = Replica(Database(fleet_db), "holder")
    got = holder.drain([r.id])
    assert [(res.id, res.status) for _, _, res in got] == [("r.d1.1", "ACCEPTED"),
                                                           ("r.d1.1", "SUCCEEDED")]
    holder.applied([seq for seq, _, _ in got])
    assert holder.drain([r.id]) == []
    assert [res.id for _, _, res in holder.drain([other.id])] == ["o.d1.1"]
    # The stranger's result was never stored; a row nobody applied in a day is pruned.
    assert store.db.scalar("SELECT COUNT(*) FROM inbox") == 1
    assert holder.prune(time.time()) == 0
    assert holder.prune(time.time() + INBOX_KEEP_S + 1) == 1
    assert store.db.scalar("SELECT COUNT(*) FROM inbox") == 0
    store.close()


def _lease_owner(db: Database, rid: str) -> str | None:
    row = db.execute("SELECT owner, expires_at FROM leases WHERE rollout_id = :r",
                     {"r": rid}).fetchone()
    return None if row is None or row[1] < time.time() else str(row[0])


@PG
@pytest.mark.slow
def test_two_replicas_one_sigkilled_mid_rollout_lose_nothing_and_run_nothing_twice(
    sim_fleet: Callable[..., SimFleet], fleetctl: Callable[..., Any], broker: Any,
    tmp_path: Path, subprocess_env: dict[str, str], fleet_db: str,
) -> None:
    fleet = sim_fleet(devices=80, behavior={"job_duration_s": 1.5})
    r = fleetctl("rollout", "create", "--detach", "--name", "ha", "--group", "sim", "--job",
                 "deploy", "--args", '{"version": "v2"}', "--waves", "1,20%,100%",
                 "--bake-s", "0.2", "--max-per-minute", "6000")
    assert r.returncode == 0, r.stdout + r.stderr
    lease_s = 3.0
    argv = [*fleetctl_argv(broker, tmp_path, fleet_db), "--lease-s", str(lease_s),
            "controller", "--forever"]
    procs = [subprocess.Popen(argv, env=subprocess_env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / f"replica{i}.log", "wb"))  # noqa: SIM115
             for i in range(2)]
    db = Database(fleet_db)
    try:
        until(lambda: _lease_owner(db, "ha") is not None, 30, "a replica to take the rollout")
        # Kill the holder in the last wave, with executions in flight on the devices.
        until(lambda: db.scalar("SELECT COUNT(*) FROM executions WHERE wave = 2 AND status "
                                "IN ('ACCEPTED', 'IN_PROGRESS')") > 10, 60, "the last wave")
        owner = _lease_owner(db, "ha")
        assert owner is not None
        victim = next(p for p in procs if owner.endswith(f"-{p.pid}"))
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        killed_at = time.monotonic()
        survivor = next(p for p in procs if p is not victim)
        until(lambda: _lease_owner(db, "ha") == owner.rsplit("-", 1)[0] + f"-{survivor.pid}",
              lease_s + 10, "the survivor's takeover")
        taken = time.monotonic() - killed_at
        assert taken <= lease_s + 5, taken
        until(lambda: db.scalar("SELECT state FROM rollouts WHERE id = 'ha'") == "succeeded",
              60, "the survivor to finish the rollout")
        assert time.monotonic() - killed_at < 60
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    store = FleetStore(fleet_db)
    jobs = store.executions("ha", "job")
    assert len(jobs) == 80 and {e.status for e in jobs} == {"SUCCEEDED"}  # no result lost
    assert {e.attempt for e in jobs} == {1}  # none timed out and was retried with a new id
    key = jobs[0].id.rsplit(".", 2)[0] + "."
    for d in fleet.devices.values():
        runs = [j for j in d.executed if j.startswith(key)]
        assert runs == [f"{key}{d.id}.1"], (d.id, runs)  # started once, never again
    # The survivor re-sent what was open; the devices answered DUPLICATE, nothing re-ran.
    assert sum(d.duplicates for d in fleet.devices.values()) > 0
    assert json.loads(fleetctl("rollout", "status", "ha", "--json").stdout)["state"] \
        == "succeeded"


@BOTH_ENGINES
def test_a_replica_that_lost_its_lease_cannot_overwrite_the_new_holders_rows(
    fleet_db: str,
) -> None:
    store = FleetStore(fleet_db)
    r = store.create_rollout(RolloutPlan(name="r", group="g", job="deploy"), ["d1"])
    e = Execution("r.d1.1", r.id, "d1", 0, "job", 1, "SENT", 1.0, sent_at=1.0)
    store.save_executions([e], "a")
    assert Replica(Database(fleet_db), "b", lease_s=30).acquire(r.id)  # b took it over
    e.status = "SUCCEEDED"
    store.save_executions([e], "a")  # a stalled past its lease, then flushed its turn
    assert store.executions(r.id)[0].status == "SENT"
    store.save_executions([e], "b")
    assert store.executions(r.id)[0].status == "SUCCEEDED"
    store.close()


@pytest.mark.parametrize("flag", ["--lease-s", "--reask-s"])
@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_a_lease_or_reask_period_under_a_second_is_refused(
    flag: str, value: str, subprocess_env: dict[str, str],
) -> None:
    r = subprocess.run([sys.executable, "-m", "fleet.cli", flag, value, "rollout", "list"],
                       capture_output=True, text=True, env=subprocess_env, timeout=60)
    assert r.returncode == 2 and f"argument {flag}:" in r.stderr, r.stderr
