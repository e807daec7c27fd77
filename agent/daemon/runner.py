"""The job queue's one consumer: one job at a time, each in its own worker process.

The job store is the queue. This thread resumes IN_PROGRESS jobs first (a crash or reboot
interrupted them), then takes the oldest QUEUED one, runs ``python -m agent.jobs.worker`` for
it (torch lives only there, so a crash or OOM kill takes the worker, not the daemon), and
announces what the store says: IN_PROGRESS with throttled progress, then the one terminal
status the worker persisted. The daemon's own decisions (expired in the queue, timed out,
canceled while queued, crashed too often) are persisted here before they are announced.

One job per state dir: while another process holds the state dir's job lock (``agentctl
finetune`` in the foreground), no worker is started and the queue waits; a worker that
finds the lock taken all the same exits 5 (``EX_BUSY``) with its job untouched, and the job
starts once the lock is free.

The worker starts with ``python -P`` (3.11+) in the state dir under umask 077: neither the
daemon's working directory nor anyone else's files can shadow a module, and what it creates
is the service user's alone. Between jobs (and every ``PRUNE_EVERY_S`` when idle) this thread
prunes the finished history (``Daemon.prune``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.daemon.announce import Announcer
from agent.daemon.config import LimitsConfig
from agent.daemon.device import governor_of
from agent.jobs.protocol import EX_BUSY, EX_TEMPFAIL, python_argv
from agent.jobs.store import JobRecord, JobState, JobStore, JobStoreError

log = logging.getLogger("agent.daemon.runner")

PRUNE_EVERY_S = 60.0
"""Idle pruning period: a flood of refused commands is cut back to the limits within it."""


def _err(code: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"code": code, "message": message, "retryable": retryable}


@dataclass
class Running:
    rec: JobRecord
    proc: subprocess.Popen[bytes]
    deadline: float | None
    last_progress: dict[str, Any] | None = None
    last_progress_at: float = 0.0
    kill_at: float | None = None
    """When a cancel or timeout was asked of the worker: SIGKILL after the grace."""
    why: str | None = None
    """'timeout' or 'cancel' once the daemon decided to stop the worker."""
    governor: str | None = None
    """The fine-tune governor's last reported state (a change is a throttle event)."""


class JobRunner:
    def __init__(
        self, store: JobStore, announcer: Announcer, state_dir: Path, limits: LimitsConfig,
        *, worker_argv: Callable[[str], list[str]] | None = None,
        crashes: Callable[[str], int] | None = None,
        worker_env: dict[str, str] | None = None,
        prune: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.ann = announcer
        self.state_dir = state_dir
        self.limits = limits
        self._worker_argv = worker_argv or self._default_argv
        self._count_crash = crashes or (lambda job_id: 1)
        self._env = worker_env
        self._prune = prune
        self._next_prune = 0.0
        self._held_by: str | None = None
        """The job (of another process) holding the state dir's job lock, last we looked."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.current: Running | None = None
        self._thread = threading.Thread(target=self._loop, name="jobs", daemon=True)
        self.log_dir = state_dir / "logs"

    def _default_argv(self, job_id: str) -> list[str]:
        # --job-id=ID: an id is never read as an option, whatever it starts with.
        return python_argv("agent.jobs.worker", f"--state-dir={self.state_dir.absolute()}",
                           f"--job-id={job_id}")

    # -- control ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Ask the running worker to checkpoint (SIGTERM; it exits 75 and the job stays
        IN_PROGRESS), kill it after the grace, and end the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(self.limits.stop_grace_s + 5)

    def progress(self) -> dict[str, Any] | None:
        cur = self.current
        return dict(cur.last_progress, id=cur.rec.id) if cur and cur.last_progress else (
            {"id": cur.rec.id, "stage": "starting"} if cur else None
        )

    def cancel(self, job_id: str) -> tuple[str, dict[str, Any] | None]:
        """The cancel command's own outcome: (status, error)."""
        with self._lock:
            rec = self.store.get(job_id)
            if rec is None:
                return "FAILED", _err("NOT_FOUND", f"no job {job_id!r} on this device")
            if rec.terminal:
                return "FAILED", _err(
                    "NOT_CANCELABLE", f"job {job_id!r} already ended {rec.state.value}")
            self.store.request_cancel(job_id)
            running = self.current is not None and self.current.rec.id == job_id
            if rec.state is JobState.QUEUED and not running:
                rec = self.store.transition(job_id, JobState.CANCELED, error=_err(
                    "CANCELED", "canceled while queued"))
                self.ann.announce_job(rec)
            elif running and self.current is not None and self.current.kill_at is None:
                # The worker checks the flag at each step and optimizer step; one that does
                # not stop within the grace is killed.
                self.current.kill_at = time.monotonic() + self.limits.cancel_grace_s
                self.current.why = "cancel"
            return "SUCCEEDED", None

    # -- the loop -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._maybe_prune()
                rec = self._next()
                if rec is None:
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                self._run(rec)
                self._next_prune = 0.0  # a job ended: the history grew
            except Exception:
                log.exception("job runner iteration failed; retrying in 1 s")
                self._stop.wait(1.0)

    def _maybe_prune(self) -> None:
        if self._prune is None or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        try:
            self._prune()
        except Exception:  # a full disk or a busy database: the next round tries again
            log.exception("pruning the job history failed")

    def _next(self) -> JobRecord | None:
        if self._lock_taken():
            return None
        unfinished = self.store.unfinished()
        if unfinished:
            return unfinished[0]
        with self._lock:
            # Expired and canceled jobs end here, one after the other, without a pause:
            # a queue of them must not hold up the first job that can run.
            while (rec := self.store.next_queued()) is not None:
                expires = (rec.reply or {}).get("expires_at")
                if expires is not None and time.time() > float(expires):
                    rec = self.store.transition(rec.id, JobState.FAILED, error=_err(
                        "EXPIRED", "expired in the queue before it could start"))
                    self.ann.announce_job(rec)
                elif rec.cancel_requested:
                    rec = self.store.transition(rec.id, JobState.CANCELED,
                                                error=_err("CANCELED", "canceled while queued"))
                    self.ann.announce_job(rec)
                else:
                    return rec
            return None

    def _lock_taken(self) -> bool:
        """Whether another process runs a job on this state dir (logged when it starts and
        ends): the queue waits for it."""
        from agent.storage.lock import job_holder

        holder = job_holder(self.state_dir)
        if holder != self._held_by:
            if holder is not None:
                log.info("the state dir is busy with %s: queued jobs wait for it", holder)
            else:
                log.info("the state dir is free again: the queue moves on")
            self._held_by = holder
        return holder is not None

    def _spawn(self, rec: JobRecord) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.log_dir / f"{rec.id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
        with open(fd, "ab") as out:
            return subprocess.Popen(
                self._worker_argv(rec.id), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, env=self._env,
                cwd=self.state_dir, umask=0o077,
            )

    def _run(self, rec: JobRecord) -> None:
        timeout = rec.timeout_s or self.limits.default_job_timeout_s
        with self._lock:
            proc = self._spawn(rec)
            deadline = None
            if timeout:
                started = rec.started_at or time.time()
                deadline = time.monotonic() + max(0.0, started + timeout - time.time())
            self.current = Running(rec, proc, deadline)
        log.info("job %s (%s) started in worker pid %d (attempt %d)", rec.id, rec.type,
                 proc.pid, rec.attempt + 1)
        try:
            code = self._watch(self.current)
        finally:
            with self._lock:
                cur, self.current = self.current, None
        self._finish(cur, code)

    def _watch(self, cur: Running) -> int | None:
        """Poll the worker and the store until the worker exits; None when the daemon is
        stopping and the worker had to be killed."""
        term_sent_at: float | None = None
        announced_running = False
        while True:
            code = cur.proc.poll()
            if code is not None:
                return code
            now = time.monotonic()
            if self._stop.is_set() and term_sent_at is None:
                self._signal(cur.proc, signal.SIGTERM)
                term_sent_at = now
            if term_sent_at is not None and now - term_sent_at > self.limits.stop_grace_s:
                self._signal(cur.proc, signal.SIGKILL)
                cur.proc.wait()
                return None
            if cur.deadline is not None and now > cur.deadline and cur.why is None:
                log.warning("job %s passed its timeout: stopping its worker", cur.rec.id)
                cur.why, cur.kill_at = "timeout", now + self.limits.cancel_grace_s
                self._signal(cur.proc, signal.SIGTERM)
            if cur.kill_at is not None and now > cur.kill_at:
                self._signal(cur.proc, signal.SIGKILL)
            rec = self.store.get(cur.rec.id)
            if rec is not None and rec.state is JobState.IN_PROGRESS:
                progress = self._current_progress(rec)
                due = now - cur.last_progress_at >= self.limits.progress_interval_s
                stage_changed = (progress or {}).get("stage") != (
                    cur.last_progress or {}).get("stage")
                if not announced_running or stage_changed or (
                        due and progress != cur.last_progress):
                    self.ann.announce_job(rec, progress=progress)
                    announced_running = True
                    cur.last_progress, cur.last_progress_at = progress, now
                self._governor_changed(cur, rec.progress)
            self._stop.wait(0.1)

    def _current_progress(self, rec: JobRecord) -> dict[str, Any] | None:
        """The job's progress row, or just its running step when the row is about another
        one (only the fine-tune writes progress; the step records say where the job is)."""
        running = [s.name for s in self.store.steps(rec.id) if s.status == "running"]
        stage = running[-1] if running else None
        if stage is None or (rec.progress or {}).get("stage") == stage:
            return rec.progress
        return {"id": rec.id, "stage": stage}

    def _governor_changed(self, cur: Running, progress: dict[str, Any] | None) -> None:
        gov = governor_of(progress)
        if gov is None or gov.state == cur.governor:
            return
        previous, cur.governor = cur.governor, gov.state
        if previous is None and gov.state == "NORMAL":
            return  # the first reading of an unthrottled run is not news
        detail = (progress or {}).get("detail") or {}
        self.ann.event("throttle", {
            "job_id": cur.rec.id, "state": gov.state, "previous": previous, "duty": gov.duty,
            "reason": gov.reason, "temp_c": detail.get("temp_c"),
            "step": (progress or {}).get("step")})

    def _finish(self, cur: Running, code: int | None) -> None:
        rec = self.store.get(cur.rec.id)
        assert rec is not None
        if rec.terminal:
            self.ann.announce_job(rec)
            log.info("job %s ended %s", rec.id, rec.state.value)
            return
        if code is None or (code == EX_TEMPFAIL and self._stop.is_set()):
            log.info("job %s suspended; it resumes on the next start", rec.id)
            return
        if code == EX_BUSY:  # another job took the state dir first: this one waits its turn
            log.info("job %s waits: another job runs on the state dir", rec.id)
            self._stop.wait(1.0)
            return
        if cur.why == "timeout":
            self._end(rec, JobState.TIMED_OUT, _err(
                "TIMED_OUT", f"timeout_s={rec.timeout_s or self.limits.default_job_timeout_s} "
                "passed", retryable=True))
            return
        if cur.why == "cancel":
            self._end(rec, JobState.CANCELED, _err("CANCELED", "canceled while running"))
            return
        crashes = self._count_crash(rec.id)
        tail = self._log_tail(rec.id)
        self.ann.event("error", {"job_id": rec.id, "what": "worker crashed", "exit_code": code,
                                 "crashes": crashes, "max": self.limits.max_job_attempts,
                                 "log_tail": tail})
        if crashes >= self.limits.max_job_attempts:
            self._end(rec, JobState.FAILED, _err(
                "INTERNAL", f"the worker crashed {crashes} times (last exit {code}): {tail}"))
        else:
            log.warning("job %s worker exited %s (crash %d of %d); resuming: %s", rec.id, code,
                        crashes, self.limits.max_job_attempts, tail)
            self._stop.wait(min(5.0, 0.5 * crashes))

    def _end(self, rec: JobRecord, state: JobState, error: dict[str, Any]) -> None:
        try:
            rec = self.store.transition(rec.id, state, error=error)
        except JobStoreError as e:
            log.warning("job %s: %s", rec.id, e)
            rec = self.store.get(rec.id) or rec
        self.ann.announce_job(rec)

    def _log_tail(self, job_id: str, n: int = 400) -> str:
        try:
            data = (self.log_dir / f"{job_id}.log").read_bytes()[-n:]
        except OSError:
            return "(no worker log)"
        return data.decode(errors="replace").strip().replace("\n", " | ")

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
