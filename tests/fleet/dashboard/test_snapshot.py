"""The dashboard's reads of the state db: a rollout read again builds only the executions that
changed, and reads the same as a fresh read (both engines: the raw rows come from each
driver)."""

from __future__ import annotations

import dataclasses
import time

from fleet.dashboard.snapshot import MAX_PERIOD_S, FleetReader
from fleet.rollout.plan import RolloutPlan
from fleet.rollout.report import RunCache, load_run
from fleet.rollout.store import Execution, FleetStore
from tests.fleet.conftest import BOTH_ENGINES


def _as_dicts(execs: dict[str, Execution]) -> dict[str, dict]:
    return {k: dataclasses.asdict(e) for k, e in execs.items()}


@BOTH_ENGINES
def test_a_rollout_read_again_rebuilds_only_what_changed(fleet_db: str) -> None:
    store = FleetStore(fleet_db)
    try:
        devices = [f"d{i}" for i in range(5)]
        r = store.create_rollout(RolloutPlan(name="r", group="g", job="deploy",
                                             waves=["100%"]), devices)
        now = time.time()
        execs = [Execution(f"r.{d}.1", r.id, d, 0, "job", 1, "SENT", now, sent_at=now,
                           result={"export": {"fallback": None}} if d == "d0" else None)
                 for d in devices]
        store.save_executions(execs)
        cache = RunCache()
        first = load_run(store, r.id, cache)
        assert _as_dicts(first.execs) == _as_dicts(load_run(store, r.id).execs)
        assert first.execs["r.d0.1"].result == {"export": {"fallback": None}}
        done = dataclasses.replace(execs[1], status="SUCCEEDED", finished_at=now + 1,
                                   outcome="committed")
        store.save_executions([done])
        second = load_run(store, r.id, cache)
        assert _as_dicts(second.execs) == _as_dicts(load_run(store, r.id).execs)
        assert second.execs["r.d1.1"].status == "SUCCEEDED"
        assert second.execs["r.d1.1"] is not first.execs["r.d1.1"]  # built again
        for k in ("r.d0.1", "r.d2.1", "r.d3.1", "r.d4.1"):
            assert second.execs[k] is first.execs[k]  # as read before: kept
        assert second.targets == first.targets == [(d, 0) for d in devices]
        store.add_target(r.id, "d5", 0)  # a device joined the group (--follow-group)
        third = load_run(store, r.id, cache)
        assert third.targets == load_run(store, r.id).targets == [(d, 0) for d in
                                                                   [*devices, "d5"]]

        reader = FleetReader(fleet_db)
        try:
            shown = reader.read()
            wave = shown["rollouts"][r.id]["waves"][0]
            assert (wave["succeeded"], wave["running"]) == (1, 4)
            assert shown["running"] == {d: f"deploy ({r.id}, sent)"
                                        for d in devices if d != "d1"}
            store.save_executions([dataclasses.replace(e, status="FAILED", finished_at=now + 2,
                                                       error_code="E_X") for e in execs[2:]])
            time.sleep(MAX_PERIOD_S)  # a changing rollout is read again within this
            again = reader.read()
            wave = again["rollouts"][r.id]["waves"][0]
            assert (wave["succeeded"], wave["failed"], wave["running"]) == (1, 3, 1)
            assert again["devices_key"] != shown["devices_key"]  # the table is due
            assert set(again["failed"]) == {"d2", "d3", "d4"}
        finally:
            reader.close()
    finally:
        store.close()
