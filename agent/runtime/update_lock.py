"""The update lock: an application holds a model's version steady through a critical stretch
(a recording, a batch that must be scored by one version), as Greengrass's
DeferComponentUpdate and balena's update lock let it.

One file per model, ``<state_dir>/models/<name>/update.lock``, created 0600 like everything in
the state dir (the service user's alone: an application of another user serves through
``agentctl serve`` run as that user, not from the slots). Applications take an ``flock``
*shared* lock on it while they hold updates (many may at once); the device job's commit
step takes an *exclusive* lock, non-blocking, in a poll loop (:func:`wait_for_update_locks`)
before it switches ``current``, and proceeds once it gets it, or after the device's
``limits.update_lock_max_wait_s`` (agent.yaml, never a command's to say), saying so: an
application that never lets go must not keep a device on an old model forever.

flock, not a pid file: the kernel drops a lock when its holder dies, even by kill -9, so a
crashed application never leaves the device deferring. The lock only defers a commit; it
is no mutual exclusion for the slots themselves (that is ``agent.storage.lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("agent.runtime")

LOCK_NAME = "update.lock"
LOCK_MODE = 0o600


def lock_path(state_dir: Path, name: str) -> Path:
    return Path(state_dir) / "models" / name / LOCK_NAME


def _open(path: Path) -> int:
    """The lock file's descriptor, creating it 0660; never through a symlink."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, LOCK_MODE)
        os.fchmod(fd, LOCK_MODE)  # the umask (the daemon's is 077) would drop the group's bits
        return fd
    except FileExistsError:
        return os.open(path, flags)


@contextlib.contextmanager
def hold_update_lock(state_dir: Path, name: str) -> Iterator[bool]:
    """A shared lock on the model's update lock for the ``with`` block; yields False (and
    holds nothing) when the model has no folder yet: nothing can be committed to it before
    the device job stages a version there, which the application's own deferral covers."""
    path = lock_path(state_dir, name)
    if not path.parent.is_dir():
        yield False
        return
    fd = _open(path)
    try:
        # Blocking: the commit step holds its exclusive lock only for the instant of a try.
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield True
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def wait_for_update_locks(
    state_dir: Path, name: str, max_wait_s: float, poll_s: float = 0.5,
    check: Callable[[], None] | None = None,
) -> float:
    """Wait until no application holds ``name``'s update lock, at most ``max_wait_s``;
    returns the seconds waited. Past ``max_wait_s`` it logs a warning and returns (the
    caller proceeds). ``check`` runs every poll and may raise to stop waiting (the job was
    canceled, suspended or ran out of time)."""
    path = lock_path(state_dir, name)
    if not path.parent.is_dir():
        return 0.0
    fd = _open(path)
    t0 = time.monotonic()
    announced = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                waited = time.monotonic() - t0
                if announced:
                    log.info("update lock of %s released after %.1fs: committing", name, waited,
                             extra={"fields": {"event": "update_lock_released", "model": name,
                                               "waited_s": round(waited, 3)}})
                return waited
            except BlockingIOError:
                pass
            waited = time.monotonic() - t0
            if waited >= max_wait_s:
                log.warning(
                    "an application still holds the update lock of %s after %.0fs "
                    "(limits.update_lock_max_wait_s): committing anyway; it keeps serving "
                    "its version until it lets go", name, waited,
                    extra={"fields": {"event": "update_lock_timeout", "model": name,
                                      "waited_s": round(waited, 3)}})
                return waited
            if not announced:
                log.info("an application holds the update lock of %s: waiting up to %.0fs",
                         name, max_wait_s, extra={"fields": {
                             "event": "update_lock_wait", "model": name,
                             "max_wait_s": max_wait_s}})
                announced = True
            if check is not None:
                check()
            time.sleep(max(0.0, min(poll_s, max_wait_s - waited)))
    finally:
        os.close(fd)
