"""``agentctl jobs`` (the job history from the store) and ``agentctl job ID`` (one job's steps).

Read-only and torch-free: safe to run beside the daemon or a foreground job.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from agent.cli.common import add_state_args, fail, state_dir_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", help="list the device's jobs, newest first",
                       description="The job history from STATE_DIR/jobs.db, newest first.")
    p.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    p.add_argument("--json", action="store_true", help="one JSON object per job")
    add_state_args(p, trusted=False)
    p.set_defaults(func=run_jobs)
    q = sub.add_parser("job", help="one job: its state, steps and result",
                       description="One job's state, each step (status, duration, outputs) "
                       "and its summary.")
    q.add_argument("id", help="job id (the command id, or agentctl finetune --job-id)")
    q.add_argument("--json", action="store_true", help="the stored record and steps as JSON")
    add_state_args(q, trusted=False)
    q.set_defaults(func=run_job_cmd)


def _store(args: argparse.Namespace) -> Any:
    from agent.jobs.store import JobStore

    state_dir = state_dir_of(args)
    return JobStore(state_dir) if (state_dir / "jobs.db").is_file() else None


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def run_jobs(args: argparse.Namespace) -> int:
    recs = []
    store = _store(args)
    if store is not None:
        with store:
            recs = store.list(limit=args.limit)
    for r in recs:
        if args.json:
            print(json.dumps({"id": r.id, "type": r.type, "state": r.state.value,
                              "created_at": r.created_at, "finished_at": r.finished_at,
                              "attempt": r.attempt, "outcome": (r.result or {}).get("outcome"),
                              "error": r.error}, sort_keys=True))
            continue
        outcome = (r.result or {}).get("outcome") or (r.error or {}).get("code") or ""
        took = f"{r.finished_at - r.started_at:.0f}s" if r.finished_at and r.started_at else "-"
        print(f"{r.id:<28} {r.type:<9} {r.state.value:<12} {_when(r.created_at)}  "
              f"{took:>6}  {outcome}")
    if not recs and not args.json:
        print("no jobs")
    return 0


def run_job_cmd(args: argparse.Namespace) -> int:
    from agent.jobs.display import print_rows, summary_rows

    rec, steps = None, []
    store = _store(args)
    if store is not None:
        with store:
            rec = store.get(args.id)
            steps = store.steps(args.id)
    if rec is None:
        return fail(2, f"job: no job {args.id!r} in {state_dir_of(args) / 'jobs.db'}")
    if args.json:
        print(json.dumps({"job": {**rec.__dict__, "state": rec.state.value},
                          "steps": [s.__dict__ for s in steps]}, sort_keys=True, default=str))
        return 0
    for s in steps:
        took = f"{s.finished_at - s.started_at:.1f}s" if s.finished_at and s.started_at else "-"
        why = (s.error or {}).get("message") or (s.outputs or {}).get("why") or ""
        print(f"{s.name:<9} {s.status:<8} {took:>7}  {why}")
    print_rows(summary_rows(rec, steps))
    return 0
