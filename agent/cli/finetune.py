"""``agentctl finetune``: the whole device job in the foreground (no daemon needed).

pull -> fine-tune -> export -> stage -> health -> commit | rollback -> upload, the same state
machine and job store the daemon uses (``agent.jobs``), with one progress display across the
stages and a summary at the end. Flags are derived from :class:`agent.jobs.spec.DeviceJob`.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.cli.common import add_state_args, fail, state_dir_of
from agent.jobs.protocol import EX_BUSY, EX_TEMPFAIL
from agent.jobs.spec import DeviceJob
from hpc_core.config import ConfigError
from hpc_core.job_args import add_job_arguments, job_tree, validate_job

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

EPILOG = """\
The job fine-tunes the installed model on this device's data inside the memory budget (the
whole process tree: probes, training child and this process), paced by the governor reading
--sensors, exports and gates it (INT8 first), stages it in the standby slot, checks it on
held-out device data against the active model, and commits it only if it is at least as good.
Progress goes to stderr (a live line at a terminal, JSON lines otherwise); the summary last.

examples:
  agentctl finetune --model digits --data device.npz --state-dir runs/device \\
      --profile generic-x86 --sensors sim --trainable all --steps 60 --budget-mb 450
  agentctl finetune --model digits --version 2 --registry http://reg:8080 --data /data/cam0
  agentctl finetune --config job.yaml --set finetune.lr=3e-3 --job-id nightly-7
  agentctl finetune --job-id nightly-7 --resume     # continue it after a reboot or SIGTERM
  agentctl jobs; agentctl job nightly-7             # history, and one job's steps

In the foreground (run as root or the service user) the flags may name paths, a registry and
keys. With --daemon/--follow the job goes to the running edge-agent as a command, which
carries names and numbers only: --data is a data set under the daemon's data_root, and
--registry, --trusted-keys, --signing-key, --upload-to and --trt-timing-cache are refused (the
daemon's come from agent.yaml).

One job runs per state dir at a time: another job running there (in the foreground or the
daemon's) refuses this one at once with exit 5 and nothing created, or after --wait-s
seconds of waiting for it to end. Refused rather than queued: a fine-tune holds the state
dir for minutes to hours, and the daemon is the queue (--daemon: it starts the job when the
running one ends, a foreground one included).

exit codes: 0 committed, 1 the job failed or rolled back (the summary says why), 2 invalid
arguments (nothing created; or found by a step before anything trained, e.g. a --micro-batch
the probes say --budget-mb cannot hold: the job ends BAD_ARGS), 5 another job is running on
the state dir (nothing created), 75 suspended by SIGTERM (resume with --resume)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        help="run the device job: fine-tune, export, gate, stage, check, commit (or roll back)",
        description="Fine-tune the installed model on this device's data and install the "
        "result only once it passed its gates and its health check.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(p, DeviceJob)
    p.add_argument("--job-id", metavar="NAME",
                   help="job name in the store and its folder STATE_DIR/jobs/NAME "
                   "(default: ft-UTCSTAMP)")
    p.add_argument("--resume", action="store_true",
                   help="continue the job --job-id where it stopped (its spec is the stored one)")
    p.add_argument("--timeout-s", type=float, metavar="S", help="fail the job after S seconds")
    p.add_argument("--wait-s", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for a job already running on the state dir to "
                   "end (default 0: refuse at once, exit 5)")
    p.add_argument("--progress", choices=("auto", "live", "json", "plain"), default="auto",
                   help="progress display: live line at a terminal, JSON lines otherwise")
    add_state_args(p, trusted=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    term = {"seen": False}

    def on_term(signum: int, frame: Any) -> None:  # start-up: remember, stop at the next check
        term["seen"] = True

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return _run(args, term)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, term: dict[str, bool]) -> int:
    state_dir = state_dir_of(args)
    job_id = args.job_id or "ft-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if not JOB_ID_RE.match(job_id):
        return fail(2, f"finetune: --job-id {job_id!r}: letters, digits, . _ - (max 64)")
    if args.wait_s < 0:
        return fail(2, f"finetune: --wait-s {args.wait_s}: a number of seconds, 0 or more")
    refused = _check_job(args, state_dir, job_id)
    if refused is not None:
        return refused
    spec = None
    if not args.resume:
        try:
            spec = _checked_spec(args, state_dir)
        except ValueError as e:
            return fail(2, f"finetune: {e}")
    if term["seen"]:
        return fail(128 + signal.SIGTERM, "finetune: SIGTERM during start-up: nothing done")
    from agent.storage.lock import JobBusyError, JobLock

    def waiting(holder: str) -> None:
        print(f"finetune: waiting up to {args.wait_s:g} s for {holder} to end (one job per "
              f"state dir)", file=sys.stderr)

    # Held from here (before the job is stored, so before its version is named) to the end
    # of the job: a second job on this state dir waits or is refused, never runs beside it.
    try:
        with JobLock(state_dir, job_id, args.wait_s,
                     on_wait=waiting if args.wait_s > 0 else None):
            # Again under the lock: another process may have stored this id meanwhile.
            refused = _check_job(args, state_dir, job_id)
            if refused is not None:
                return refused
            return _submit_and_execute(args, state_dir, job_id, spec, term)
    except JobBusyError as e:
        hint = ("nothing was created; run it again once that one ends, wait for it with "
                "--wait-s, or queue this job behind it with --daemon")
        return fail(EX_BUSY, f"finetune: {e}: one job runs per state dir at a time: {hint}")


def _check_job(args: argparse.Namespace, state_dir: Path, job_id: str) -> int | None:
    """The exit status refusing ``--job-id`` as given (exists without --resume, or --resume
    of no such finetune job), or None."""
    from agent.jobs.store import JobStore

    db = state_dir / "jobs.db"
    existing = None
    if db.is_file():
        with JobStore(state_dir) as store:
            existing = store.get(job_id)
    folder = state_dir / "jobs" / job_id
    if args.resume:
        if existing is None:
            return fail(2, f"finetune: --resume: no job {job_id!r} in {db}")
        if existing.type != "finetune":
            return fail(2, f"finetune: --resume: job {job_id!r} is a {existing.type} job")
        return None
    if existing is not None or folder.exists():
        where = existing.state.value if existing is not None else str(folder)
        return fail(2, f"finetune: job {job_id!r} exists ({where}): pass --resume to "
                    "continue it or another --job-id")
    return None


def _checked_spec(args: argparse.Namespace, state_dir: Path) -> DeviceJob:
    """The job the flags describe, checked on the file system; ValueError naming the flag."""
    try:
        spec = validate_job(DeviceJob, job_tree(args), "device job")
    except ConfigError as e:
        raise ValueError(_one_line(e)) from None
    from agent.jobs.preflight import check_inputs, check_signing_key

    check_inputs(spec, state_dir)
    check_signing_key(spec, state_dir)
    if spec.finetune.profile != "auto":  # type: ignore[attr-defined]
        from device_profiles import ProfileError, load_profile

        try:
            load_profile(spec.finetune.profile)  # type: ignore[attr-defined]
        except ProfileError as e:
            raise ValueError(f"--profile: {e}") from None
    return spec


def _submit_and_execute(args: argparse.Namespace, state_dir: Path, job_id: str,
                        spec: DeviceJob | None, term: dict[str, bool]) -> int:
    from agent.jobs.store import JobStore

    if spec is not None:
        with JobStore(state_dir) as store:
            _, created = store.submit(job_id, "finetune", spec.model_dump(mode="json"),
                                      timeout_s=args.timeout_s, source="cli")
        if not created:  # stored by the daemon meanwhile: never run one job twice
            return fail(2, f"finetune: job {job_id!r} exists: pass --resume to continue it or "
                        "another --job-id")
    if term["seen"]:  # the job is stored (QUEUED): --resume picks it up
        return fail(EX_TEMPFAIL, f"finetune: SIGTERM: job {job_id} not started; continue it "
                    "with --resume")
    return _execute(state_dir, job_id, args.progress, term)


def _execute(state_dir: Path, job_id: str, progress: str, term: dict[str, bool]) -> int:
    from agent.jobs.display import ProgressDisplay, print_rows, summary_rows
    from agent.jobs.protocol import StopFlag
    from agent.jobs.store import JobState, JobStore
    from agent.jobs.worker import run_job

    stop = StopFlag()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if term["seen"]:
        stop.set()
    with JobStore(state_dir) as store:
        mode = None if progress == "auto" else progress
        with ProgressDisplay(store, job_id, mode) as display:  # type: ignore[arg-type]
            code = run_job(state_dir, job_id, on_event=display.on_event, stop=stop)
        rec = store.get(job_id)
        assert rec is not None
        if code == EX_TEMPFAIL:
            return fail(EX_TEMPFAIL, f"finetune: suspended by SIGTERM; continue with --job-id "
                        f"{job_id} --resume")
        print_rows(summary_rows(rec, store.steps(job_id)))
        print(json.dumps({"job": job_id, "state": rec.state.value, "result": rec.result,
                          "error": rec.error}, sort_keys=True))
        if rec.state is JobState.SUCCEEDED:
            return 0
        # A step found the arguments impossible here before anything trained (a forced
        # micro-batch over the budget, a spool too small): bad input, as at submission.
        return 2 if (rec.error or {}).get("code") == "BAD_ARGS" else 1


def _one_line(e: ConfigError) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text if len(text) < 400 else text[:400] + " ..."

