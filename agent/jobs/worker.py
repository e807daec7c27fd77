"""``python -P -m agent.jobs.worker --state-dir=DIR --job-id=ID``: run one job from the store.

The daemon passes the id as ``--job-id=ID`` (an id is never read as an option) and starts
the worker with ``-P`` in the state dir; the children it starts for the torch steps inherit
``PYTHONSAFEPATH``, so no working directory ever shadows a module.

Exit codes: 0 the job reached a terminal state (read it from the store), 75 suspended by
SIGTERM (the job stays IN_PROGRESS and resumes on the next start), 5 another job holds the
state dir (this one was not touched: it runs once that one ends), anything else: crashed.
The worker dies with its parent, so a kill -9 of the daemon never leaves two workers behind.

One job per state dir: the worker runs its job holding the state dir's job lock
(``agent.storage.lock.JobLock``), from before the job's version is named to its end, whoever
started it (the daemon's runner, or ``agentctl finetune`` in the foreground, which calls
:func:`run_job` in its own process).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.jobs.machine import TRANSITIONS, WORKER_STEPS, planned_steps, run
from agent.jobs.protocol import (
    EX_BUSY,
    EX_TEMPFAIL,
    JobContext,
    StopFlag,
    Suspended,
)
from agent.jobs.spec import SPECS
from agent.jobs.store import JobState, JobStore
from contract import check_command_id
from registry.atomic import remove_stale_temps
from registry.lifetime import die_with_parent, skip_startup_and_exit_collections

log = logging.getLogger(__name__)


def run_job(
    state_dir: Path, job_id: str, on_event: Callable[[str, dict[str, Any]], None] | None = None,
    stop: StopFlag | None = None,
) -> int:
    """Run (or resume) ``job_id`` in this process, holding the state dir's job lock; returns
    the worker exit code (:data:`EX_BUSY`, the job untouched, when another job holds it).
    ``stop``: the flag this process's SIGTERM handler sets (the job suspends at the next
    check)."""
    from agent.storage.lock import JobBusyError, JobLock

    try:
        with JobLock(state_dir, job_id):
            return _run_locked(state_dir, job_id, on_event, stop)
    except JobBusyError as e:
        print(f"worker: job {job_id} not started: {e}", file=sys.stderr)
        return EX_BUSY


def _run_locked(
    state_dir: Path, job_id: str, on_event: Callable[[str, dict[str, Any]], None] | None,
    stop: StopFlag | None,
) -> int:
    with JobStore(state_dir) as store:
        return _run_stored(store, state_dir, job_id, on_event, stop)


def _run_stored(
    store: JobStore, state_dir: Path, job_id: str,
    on_event: Callable[[str, dict[str, Any]], None] | None, stop: StopFlag | None,
) -> int:
    rec = store.get(job_id)
    if rec is None:
        print(f"worker: no job {job_id!r} in {store.path}", file=sys.stderr)
        return 2
    if rec.terminal:
        return 0
    if rec.type not in SPECS or rec.type not in TRANSITIONS:
        store.transition(job_id, JobState.FAILED, error={
            "code": "UNAVAILABLE", "message": f"job type {rec.type!r} is not one of "
            f"{sorted(TRANSITIONS)}", "retryable": False})
        return 0
    rec = store.transition(job_id, JobState.IN_PROGRESS)
    spec = SPECS[rec.type].model_validate(rec.spec)
    deadline = rec.started_at + rec.timeout_s if rec.timeout_s and rec.started_at else None
    # `is not None`, not `or`: a StopFlag is falsy until set, and `stop or StopFlag()` dropped
    # the flag main()'s SIGTERM handler sets, so a SIGTERM never suspended the job.
    ctx = JobContext(store, job_id, Path(state_dir), spec, deadline=deadline, on_event=on_event,
                     stop=stop if stop is not None else StopFlag(),
                     planned=planned_steps(TRANSITIONS[rec.type], spec))
    ctx.job_dir.mkdir(parents=True, exist_ok=True)
    # A previous attempt killed mid-write (kill -9, power cut) leaves its temp files here.
    remove_stale_temps(ctx.job_dir, recursive=True)
    try:
        run(ctx, rec.type, WORKER_STEPS)
    except Suspended:
        return EX_TEMPFAIL
    return 0


def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    p = argparse.ArgumentParser(prog="python -m agent.jobs.worker", description=__doc__)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--no-parent-check", action="store_true",
                   help="run detached (tests, a shell): do not die with the parent")
    a = p.parse_args(argv)
    try:
        check_command_id(a.job_id, "--job-id")
    except ValueError as e:
        p.error(str(e))
    os.environ["PYTHONSAFEPATH"] = "1"  # the torch children: never import from their cwd
    if not a.no_parent_check:
        die_with_parent()
    stop = StopFlag()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if threading.current_thread() is threading.main_thread():
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.monotonic()
    code = run_job(a.state_dir, a.job_id, stop=stop)
    log.info("worker done in %.1fs, exit %d", time.monotonic() - t0, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
