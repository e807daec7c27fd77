"""The fleet db on both engines (SQLite, PostgreSQL): the same store semantics, and a db
written before ``completed_with_failures`` existed reads right."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fleet.db import Database
from fleet.rollout.plan import RolloutPlan
from fleet.rollout.store import SCHEMA_VERSION, Execution, FleetStore
from tests.fleet.conftest import BOTH_ENGINES


def _old_db(db: str, execs: dict[str, list[tuple[str, str | None]]]) -> None:
    """A version-0 db: one finished rollout recorded ``succeeded``, per device its job
    attempts as (status, outcome)."""
    store = FleetStore(db)
    r = store.create_rollout(RolloutPlan(name="old", group="g", job="deploy"), list(execs))
    rows = []
    for dev, attempts in execs.items():
        for n, (status, outcome) in enumerate(attempts, 1):
            rows.append(Execution(f"old.{dev}.{n}", r.id, dev, 0, "job", n, status, float(n),
                                  outcome=outcome))
    store.save_executions(rows)
    store.set_rollout_state(r.id, "succeeded")
    if store.db.dialect == "sqlite":
        # What a version-0 file has: no fleet_schema table, PRAGMA user_version 0.
        store.db.execute("DROP TABLE fleet_schema")
        store.db.execute("PRAGMA user_version = 0")
    else:
        store.db.execute("UPDATE fleet_schema SET version = 0")
    store.close()


def _state(db: str) -> str:
    store = FleetStore(db)
    try:
        r = store.rollout("old")
        assert r is not None and r.finished_at is not None
        return r.state
    finally:
        store.close()


def _fresh(db: str, tmp_path: Path, name: str) -> str:
    """A second empty db of the same engine as ``db``."""
    if db.startswith("postgresql://"):
        base = db.rpartition("/")[0]
        Database(db).execute(f"CREATE DATABASE {name}")
        return f"{base}/{name}"
    return str(tmp_path / f"{name}.db")


@BOTH_ENGINES
def test_an_old_succeeded_rollout_with_a_failed_device_reads_completed_with_failures(
    fleet_db: str, tmp_path: Path,
) -> None:
    _old_db(fleet_db, {"d1": [("SUCCEEDED", "committed")],
                       "d2": [("FAILED", None), ("TIMED_OUT", None)]})
    assert _state(fleet_db) == "completed_with_failures"
    other = _fresh(fleet_db, tmp_path, "gates")
    _old_db(other, {"d1": [("SUCCEEDED", "committed")],
                    "d2": [("SUCCEEDED", "rolled_back")]})  # its gates said no
    assert _state(other) == "completed_with_failures"


@BOTH_ENGINES
def test_an_old_rollout_whose_retry_succeeded_stays_succeeded(fleet_db: str) -> None:
    _old_db(fleet_db, {"d1": [("SUCCEEDED", "committed")],
                       "d2": [("FAILED", None), ("SUCCEEDED", "committed")]})
    assert _state(fleet_db) == "succeeded"
    assert Database(fleet_db).scalar("SELECT version FROM fleet_schema") == SCHEMA_VERSION


def test_a_version_1_sqlite_file_is_upgraded_in_place(tmp_path: Path) -> None:
    """A file the previous release wrote (PRAGMA user_version 1, no fleet_schema) keeps its
    rollouts and gains the version row and the replicas' tables."""
    db = tmp_path / "fleet.db"
    store = FleetStore(db)
    store.create_rollout(RolloutPlan(name="kept", group="g", job="deploy"), ["d1"])
    for table in ("fleet_schema", "leases", "inbox"):
        store.db.execute(f"DROP TABLE {table}")
    store.db.execute("PRAGMA user_version = 1")
    store.close()
    store = FleetStore(db)
    assert [r.id for r in store.rollouts()] == ["kept"]
    assert store.db.scalar("SELECT version FROM fleet_schema") == SCHEMA_VERSION
    assert store.db.has_table("leases") and store.db.has_table("inbox")
    store.close()
    with sqlite3.connect(db) as c:  # the file stays a plain SQLite file anyone can read
        assert c.execute("SELECT COUNT(*) FROM targets").fetchone()[0] == 1


@BOTH_ENGINES
def test_store_semantics_are_the_same_on_both_engines(fleet_db: str) -> None:
    store = FleetStore(fleet_db)
    plan = RolloutPlan(name="r", group="g", job="deploy", waves=["1", "100%"])
    a = store.create_rollout(plan, ["d3", "d1", "d2"])
    b = store.create_rollout(plan, ["d1"])
    assert (a.id, b.id) == ("r", "r-2")
    assert store.targets(a.id) == [("d1", 0), ("d2", 1), ("d3", 1)]
    assert [w.target for w in store.waves(a.id)] == [1, 3]
    # Upsert by id: the second save of an execution replaces the first, floats keep their
    # precision (timestamps are doubles on both engines).
    t = 1_790_000_000.123456
    e = Execution("r-x.d1.1", a.id, "d1", 0, "job", 1, "SENT", t, sent_at=t)
    store.save_executions([e])
    e.status, e.result = "SUCCEEDED", {"outcome": "committed", "n": [1, 2]}
    store.save_executions([e])
    (got,) = store.executions(a.id)
    assert (got.status, got.result, got.sent_at) == ("SUCCEEDED", e.result, t)
    assert store.executions(a.id, "rollback") == []
    # An operator request is taken once.
    assert store.post_request(a.id, "pause", states=("running",))
    assert not store.post_request(b.id, "pause", states=("paused",))
    assert store.take_request(a.id) == "pause" and store.take_request(a.id) is None
    with pytest.raises(ValueError, match="request 'stop'"):
        store.post_request(a.id, "stop")
    store.set_rollout_state(a.id, "succeeded", "done")
    assert store.reopen_for_rollback(a.id) and not store.reopen_for_rollback(a.id)
    r = store.rollout(a.id)
    assert r is not None and (r.state, r.reason, r.finished_at) == ("rolling_back", "done", None)
    assert [x.id for x in store.rollouts(("running",))] == ["r-2"]
    store.close()
