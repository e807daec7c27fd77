"""The job store: transitions, idempotent submit, steps, durability across processes."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.jobs.store import TERMINAL, JobState, JobStore, JobStoreError


def test_submit_is_idempotent_on_id(tmp_path: Path) -> None:
    s = JobStore(tmp_path)
    rec, created = s.submit("c1", "finetune", {"lr": 0.1}, timeout_s=60, source="mqtt",
                            reply={"response_topic": "r"})
    assert created and rec.state is JobState.QUEUED and rec.attempt == 0
    assert rec.spec == {"lr": 0.1} and rec.timeout_s == 60 and rec.reply == {"response_topic": "r"}
    again, created2 = s.submit("c1", "finetune", {"lr": 9.9})
    assert not created2 and again.spec == {"lr": 0.1} and again.source == "mqtt"


def test_reject_is_stored_terminal(tmp_path: Path) -> None:
    s = JobStore(tmp_path)
    err = {"code": "BAD_ARGS", "message": "args.lr: must be > 0", "retryable": False}
    rec, created = s.reject("c2", "finetune", err, source="mqtt")
    assert created and rec.state is JobState.REJECTED and rec.error == err
    assert rec.finished_at is not None and rec.terminal
    assert s.submit("c2", "finetune", {})[1] is False
    with pytest.raises(JobStoreError, match="REJECTED -> IN_PROGRESS"):
        s.transition("c2", JobState.IN_PROGRESS)


def test_lifecycle_and_legal_transitions(tmp_path: Path) -> None:
    s = JobStore(tmp_path)
    s.submit("j", "finetune", {})
    r = s.transition("j", JobState.IN_PROGRESS)
    assert r.attempt == 1 and r.started_at is not None
    started = r.started_at
    r = s.transition("j", JobState.IN_PROGRESS)  # a resume
    assert r.attempt == 2 and r.started_at == started
    r = s.transition("j", JobState.SUCCEEDED, result={"outcome": "committed"})
    assert r.result == {"outcome": "committed"} and r.finished_at is not None
    for bad in JobState:
        with pytest.raises(JobStoreError, match=f"SUCCEEDED -> {bad.value}"):
            s.transition("j", bad)
    s.submit("q", "deploy", {})
    with pytest.raises(JobStoreError, match="QUEUED -> SUCCEEDED"):
        s.transition("q", JobState.SUCCEEDED)
    with pytest.raises(JobStoreError, match="QUEUED -> REJECTED"):
        s.transition("q", JobState.REJECTED)
    assert s.transition("q", JobState.CANCELED).state is JobState.CANCELED
    with pytest.raises(JobStoreError, match="no job with id 'nope'"):
        s.transition("nope", JobState.FAILED)
    assert {JobState.SUCCEEDED, JobState.REJECTED} <= TERMINAL
    assert JobState.IN_PROGRESS not in TERMINAL


def test_queue_order_and_listing(tmp_path: Path) -> None:
    s = JobStore(tmp_path)
    for i in range(4):
        s.submit(f"j{i}", "finetune", {"i": i})
    assert s.next_queued().id == "j0"
    s.transition("j0", JobState.IN_PROGRESS)
    s.transition("j1", JobState.IN_PROGRESS)
    assert [r.id for r in s.unfinished()] == ["j0", "j1"]
    assert s.next_queued().id == "j2"
    assert [r.id for r in s.list()] == ["j3", "j2", "j1", "j0"]
    assert [r.id for r in s.list(limit=2)] == ["j3", "j2"]
    assert [r.id for r in s.list(states=[JobState.IN_PROGRESS])] == ["j1", "j0"]


def test_cancel_progress_and_steps(tmp_path: Path) -> None:
    s = JobStore(tmp_path)
    s.submit("j", "finetune", {})
    assert not s.cancel_requested("j")
    assert s.request_cancel("j").cancel_requested and s.cancel_requested("j")
    s.set_progress("j", {"id": "j", "stage": "finetune", "step": 3, "total": 10})
    assert s.get("j").progress["step"] == 3
    s.step_started("j", "pull")
    s.step_finished("j", "pull", {"version": "v1"})
    s.step_started("j", "finetune")
    s.step_failed("j", "finetune", {"code": "JOB_FAILED", "message": "x"})
    s.step_started("j", "finetune")  # resumed: same row, running again
    s.step_skipped("j", "upload", "upload: false in the job spec")
    steps = s.steps("j")
    assert [(x.name, x.status) for x in steps] == [
        ("pull", "done"), ("finetune", "running"), ("upload", "skipped")
    ]
    assert steps[0].outputs == {"version": "v1"} and steps[0].finished_at is not None
    assert steps[1].finished_at is None and steps[1].error is None
    assert steps[2].outputs == {"why": "upload: false in the job spec"}
    with pytest.raises(JobStoreError):
        s.step_started("missing", "pull")


def test_wal_and_full_sync(tmp_path: Path) -> None:
    conn = JobStore(tmp_path)._conn()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


_CHILD = """
import sys
from agent.jobs.store import JobStore, JobState
s = JobStore(sys.argv[1])
for i in range(50):
    s.submit(f"{sys.argv[2]}-{i}", "finetune", {"i": i})
    s.transition(f"{sys.argv[2]}-{i}", JobState.IN_PROGRESS)
    s.set_progress(f"{sys.argv[2]}-{i}", {"stage": "x"})
"""


def test_several_processes_share_the_db(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), f"p{k}"])
        for k in range(3)
    ]
    s = JobStore(tmp_path)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(100):
                s.list(limit=5)
                s.unfinished()
        except BaseException as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    assert all(p.wait(60) == 0 for p in procs)
    t.join()
    assert not errors
    assert len(s.list(limit=1000, states=[JobState.IN_PROGRESS])) == 150


def test_store_is_torch_free(tmp_path: Path) -> None:
    code = "import sys, agent.jobs.store; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_database_is_private_whatever_the_umask(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0)
    try:
        s = JobStore(tmp_path / "state")
        s.submit("j", "finetune", {})
    finally:
        os.umask(old)
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm"):
        assert stat.S_IMODE((tmp_path / "state" / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700


def test_submit_refuses_beyond_max_queued_without_storing(tmp_path: Path) -> None:
    from agent.jobs.store import QueueFull

    s = JobStore(tmp_path)
    for i in range(3):
        s.submit(f"q{i}", "finetune", {}, max_queued=3)
    s.transition("q0", JobState.IN_PROGRESS)  # running: no longer waiting
    s.submit("q3", "finetune", {}, max_queued=3)
    with pytest.raises(QueueFull, match="3 jobs are queued already"):
        s.submit("q4", "finetune", {}, max_queued=3)
    assert s.get("q4") is None
    assert s.submit("q1", "finetune", {}, max_queued=3)[1] is False  # a repeat is no new job


def test_prune_keeps_the_last_finished_and_never_an_unfinished_job(tmp_path: Path) -> None:
    import time

    s = JobStore(tmp_path)
    s.submit("running", "finetune", {})
    s.transition("running", JobState.IN_PROGRESS)
    s.step_started("running", "pull")
    s.submit("queued", "finetune", {})
    for i in range(6):
        s.reject(f"r{i}", "finetune", {"code": "BAD_ARGS", "message": "x"}, source="mqtt")
    s.step_started("r0", "pull")
    assert sorted(s.prune(keep=2, older_than=0)) == ["r0", "r1", "r2", "r3"]
    assert {r.id for r in s.list()} == {"running", "queued", "r4", "r5"}
    assert s.steps("r0") == [] and len(s.steps("running")) == 1
    # The job that just finished is the newest finished, whenever it was created.
    s.transition("running", JobState.SUCCEEDED)
    assert s.prune(keep=2, older_than=0) == ["r4"]
    assert sorted(s.prune(keep=100, older_than=time.time() + 1)) == ["r5", "running"]
    assert {r.id for r in s.list()} == {"queued"}
