"""The state lock: one pull, install, rollback or gc at a time on a device."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

from agent.storage.nofollow import open_fd, real_dir
from registry.errors import StateBusyError


class StateLock:
    """An exclusive flock on ``state_dir/lock``; re-entrant within one thread.

    The kernel drops a flock when its holder dies, so a SIGKILLed pull never wedges the device.
    The lock file is opened with O_NOFOLLOW: a link planted there would otherwise have the
    agent truncate whatever file it points at.
    """

    _local = threading.local()

    def __init__(self, state_dir: Path, wait_s: float = 5.0) -> None:
        self.path = Path(state_dir) / "lock"
        self.wait_s = wait_s

    def _held(self) -> dict[Path, list[int]]:
        if not hasattr(self._local, "held"):
            self._local.held = {}
        return self._local.held  # type: ignore[no-any-return]

    def __enter__(self) -> StateLock:
        held = self._held()
        if self.path in held:
            held[self.path][1] += 1
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        real_dir(self.path.parent)
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise StateBusyError(
                        f"{self.path} is held by pid {owner} (another pull, install or rollback); "
                        "wait for it to finish"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        held[self.path] = [fd, 1]
        return self

    def __exit__(self, *exc: object) -> None:
        held = self._held()
        entry = held[self.path]
        entry[1] -= 1
        if entry[1] == 0:
            del held[self.path]
            os.close(entry[0])  # closing the descriptor releases the flock
