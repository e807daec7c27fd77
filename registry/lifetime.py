"""A helper process's life tied to its parent's: killed the instant its parent dies.

The device job's worker and its torch children, and the export's QAT fine-tune (a child of the
export's own child), call :func:`die_with_parent` first: a kill -9 anywhere above them (the
daemon, the worker at a job's deadline) never leaves one running, holding memory outside the
job's budget or a core the application needs. Set in the child itself, because
``subprocess``'s ``preexec_fn`` is unsafe in a process with threads. Linux only (elsewhere a
no-op but for the check that the parent is still there).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL), then check the parent did not die before it took effect
    (exit 1 at once if it did)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:
        os._exit(1)
