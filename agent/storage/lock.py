"""The device's two locks, both an flock on a file in the state dir (0600):

- ``lock`` (:class:`StateLock`): one pull, install, rollback or gc at a time, held for the
  seconds a storage operation takes;
- ``job.lock`` (:class:`JobLock`): one job at a time, held by the process running the job
  (``agentctl finetune`` in the foreground, or the daemon's worker) from before the job is
  named to its end, so two jobs never take the same version name, sequence or slot.

The kernel drops an flock when its holder dies, so a SIGKILLed pull or job never wedges the
device. Lock files are opened with O_NOFOLLOW: a link planted there would otherwise have the
agent truncate whatever file it points at.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.storage.nofollow import open_fd, real_dir
from registry.errors import StateBusyError

JOB_LOCK = "job.lock"
PROBE_GRACE_S = 1.0
"""A job lock asked for without waiting still retries this long: :func:`job_holder` (the
daemon's look before it starts a worker) holds it for microseconds."""


class JobBusyError(StateBusyError):
    """Another job holds the state dir's job lock; ``holder`` names it ('job ID (pid N)')."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class _FileLock:
    """An exclusive flock on ``path``, re-entrant within one thread; the holder writes its
    ``label()`` into the file for whoever is refused."""

    _local = threading.local()

    def __init__(self, path: Path, wait_s: float) -> None:
        # Absolute: re-entry is recognised by path, and a second open file description of
        # the same file would conflict with this process's own flock.
        self.path = Path(os.path.abspath(path))
        self.wait_s = wait_s

    def _held(self) -> dict[Path, list[int]]:
        if not hasattr(self._local, "held"):
            self._local.held = {}
        return self._local.held  # type: ignore[no-any-return]

    def label(self) -> str:
        return str(os.getpid())

    def busy(self, fd: int) -> StateBusyError:
        """The error for a lock still held when the wait is over."""
        raise NotImplementedError

    def waiting(self, fd: int) -> None:
        """Called once when the lock is held by another and the wait begins."""

    def __enter__(self) -> _FileLock:
        held = self._held()
        if self.path in held:
            held[self.path][1] += 1
            return self
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        real_dir(self.path.parent)
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # a lock file from before it was made 0600
            os.fchmod(fd, 0o600)
        deadline = time.monotonic() + self.wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    try:
                        raise self.busy(fd) from None
                    finally:
                        os.close(fd)
                if not told:
                    told = True
                    self.waiting(fd)
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.label()}\n".encode(), 0)
        held[self.path] = [fd, 1]
        return self

    def __exit__(self, *exc: object) -> None:
        held = self._held()
        entry = held[self.path]
        entry[1] -= 1
        if entry[1] == 0:
            del held[self.path]
            os.close(entry[0])  # closing the descriptor releases the flock


def _owner(fd: int) -> str:
    return os.pread(fd, 256, 0).decode(errors="replace").strip() or "?"


class StateLock(_FileLock):
    """An exclusive flock on ``state_dir/lock``: one pull, install, rollback or gc at a time;
    re-entrant within one thread. StateBusyError after ``wait_s``."""

    def __init__(self, state_dir: Path, wait_s: float = 5.0) -> None:
        super().__init__(Path(state_dir) / "lock", wait_s)

    def busy(self, fd: int) -> StateBusyError:
        return StateBusyError(
            f"{self.path} is held by pid {_owner(fd)} (another pull, install or rollback); "
            "wait for it to finish"
        )


class JobLock(_FileLock):
    """One job per state dir: an exclusive flock on ``state_dir/job.lock``, held by the
    process running job ``job_id`` for the whole job; re-entrant within one thread.

    Waits at most ``wait_s`` (at least :data:`PROBE_GRACE_S`) for a running job to end,
    calling ``on_wait(holder)`` once when it starts waiting; then JobBusyError naming the
    job that holds it. The file holds ``PID JOB_ID`` of the holder."""

    def __init__(self, state_dir: Path, job_id: str, wait_s: float = 0.0,
                 on_wait: Callable[[str], None] | None = None) -> None:
        super().__init__(Path(state_dir) / JOB_LOCK, max(wait_s, PROBE_GRACE_S))
        self.job_id = job_id
        self.on_wait = on_wait

    def label(self) -> str:
        return f"{os.getpid()} {self.job_id}"

    def busy(self, fd: int) -> StateBusyError:
        holder = describe_holder(_owner(fd))
        return JobBusyError(f"another job is running on {self.path.parent}: {holder}", holder)

    def waiting(self, fd: int) -> None:
        if self.on_wait is not None:
            self.on_wait(describe_holder(_owner(fd)))


def describe_holder(text: str) -> str:
    """'job ID (pid N)' from a job lock file's ``PID JOB_ID``."""
    pid, _, job = text.partition(" ")
    return f"job {job or '?'} (pid {pid or '?'})"


def job_holder(state_dir: Path) -> str | None:
    """The job holding ``state_dir``'s job lock ('job ID (pid N)'), or None when no job runs.
    Looks with a shared flock taken and dropped at once (never creates the file)."""
    path = Path(state_dir) / JOB_LOCK
    try:
        fd = open_fd(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return describe_holder(_owner(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
