"""A process's life: tied to its parent's (killed the instant its parent dies), and its end.

The device job's worker and its torch children, and the export's QAT fine-tune (a child of the
export's own child), call :func:`die_with_parent` first: a kill -9 anywhere above them (the
daemon, the worker at a job's deadline) never leaves one running, holding memory outside the
job's budget or a core the application needs. Set in the child itself, because
``subprocess``'s ``preexec_fn`` is unsafe in a process with threads. Linux only (elsewhere a
no-op but for the check that the parent is still there).

Every program of this repository but the long-running daemon also calls
:func:`freeze_at_exit` in its ``main``: the interpreter's shutdown then skips its last garbage
collections, which otherwise free one by one the objects the imports created (~300,000 in
a process that trained: modules, classes and functions sit in reference cycles, which only the
collector frees); tests/registry/test_lifetime.py holds every entry point to it.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
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


_freezing_at_exit = False


def freeze_at_exit() -> None:
    """At exit, freeze every object the garbage collector tracks (once, however often called).

    Python's shutdown clears the modules and then collects every generation, freeing one by
    one what the imports created (it sits in reference cycles): 0.6-0.8 CPU s of a torch
    process that trained (a fresh memory probe 3.3 -> 2.7 CPU s on x86), 0.05-0.1 s of a
    torch-free one (``fleetctl``, the job's worker), at the end of every step of every job;
    more on a Jetson's slower cores. ``python benchmarks/process_start.py`` measures it.

    Nothing is lost: the process is ending, so what the collection would free the kernel
    frees; every atexit handler still runs (logging's flush, tempfile's clean-up; those
    registered after this one run before it). What it asks: whatever must be closed to be
    complete is closed before ``main`` returns (atomic writes, :mod:`registry.atomic`; a
    SQLite connection, whose last close removes the -wal and -shm files), never left to the
    collector, as at ``os._exit``.
    """
    global _freezing_at_exit
    if not _freezing_at_exit:
        _freezing_at_exit = True
        atexit.register(gc.freeze)
