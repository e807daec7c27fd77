"""The fleet db: a db written before ``completed_with_failures`` existed reads right."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from fleet.plan import RolloutPlan
from fleet.store import Execution, FleetStore


def _old_db(path: Path, execs: dict[str, list[tuple[str, str | None]]]) -> None:
    """A version-0 db: one finished rollout recorded ``succeeded``, per device its job
    attempts as (status, outcome)."""
    store = FleetStore(path)
    r = store.create_rollout(RolloutPlan(name="old", group="g", job="deploy"), list(execs))
    rows = []
    for dev, attempts in execs.items():
        for n, (status, outcome) in enumerate(attempts, 1):
            rows.append(Execution(f"old.{dev}.{n}", r.id, dev, 0, "job", n, status, float(n),
                                  outcome=outcome))
    store.save_executions(rows)
    store.set_rollout_state(r.id, "succeeded")
    store.db.execute("PRAGMA user_version = 0")
    store.close()


def _state(path: Path) -> str:
    store = FleetStore(path)
    try:
        r = store.rollout("old")
        assert r is not None and r.finished_at is not None
        return r.state
    finally:
        store.close()


def test_an_old_succeeded_rollout_with_a_failed_device_reads_completed_with_failures(
    tmp_path: Path,
) -> None:
    _old_db(tmp_path / "a.db", {"d1": [("SUCCEEDED", "committed")],
                                "d2": [("FAILED", None), ("TIMED_OUT", None)]})
    assert _state(tmp_path / "a.db") == "completed_with_failures"
    _old_db(tmp_path / "b.db", {"d1": [("SUCCEEDED", "committed")],
                                "d2": [("SUCCEEDED", "rolled_back")]})  # its gates said no
    assert _state(tmp_path / "b.db") == "completed_with_failures"


def test_an_old_rollout_whose_retry_succeeded_stays_succeeded(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    _old_db(db, {"d1": [("SUCCEEDED", "committed")],
                 "d2": [("FAILED", None), ("SUCCEEDED", "committed")]})
    assert _state(db) == "succeeded"
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 1
