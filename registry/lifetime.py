"""A process's life: tied to its parent's (killed the instant its parent dies), and its end.

The device job's worker and its torch children, and the export's QAT fine-tune (a child of the
export's own child), call :func:`die_with_parent` first: a kill -9 anywhere above them (the
daemon, the worker at a job's deadline) never leaves one running, holding memory outside the
job's budget or a core the application needs. Set in the child itself, because
``subprocess``'s ``preexec_fn`` is unsafe in a process with threads. Linux only (elsewhere a
no-op but for the check that the parent is still there).

Every program of this repository but the long-running daemon also calls
:func:`skip_startup_and_exit_collections` first in its ``main``: the garbage collector's full
passes while the imports grow the heap, and its last passes at exit, are skipped (a third of
a second and more of every torch process); tests/registry/test_lifetime.py holds every entry
point to it.

A program that serves until SIGTERM (``agentctl serve``, ``fleetctl dashboard``, the simulated
fleet) waits for it in :func:`wait_for_stop`, never in an untimed ``Event.wait()``.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys
import threading


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL), then check the parent did not die before it took effect
    (exit 1 at once if it did)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:
        os._exit(1)


FULL_COLLECTION_EVERY = 1000
"""Passes over the collector's middle generation between two full passes (CPython's default:
10). Only the full passes change: the young generations are collected as often as before."""

_skipping = False


def skip_startup_and_exit_collections() -> None:
    """The collector's needless full passes skipped: those of the start-up and of the exit.

    Start-up: while the imports grow the heap (torch alone ~170,000 tracked objects, ~300,000
    in a process that trained) CPython runs a full pass each time it grew by a quarter, and each
    traverses everything so far: 5 of them, 0.37-0.40 CPU s, in a memory probe's start-up,
    where its training then ran none. Full passes now wait for
    :data:`FULL_COLLECTION_EVERY` middle-generation passes; young garbage, cycles included, is
    collected as before, and a program that runs on still gets full passes.

    Exit: Python's shutdown clears the modules and then collects every generation, freeing one
    by one what the imports created (it sits in reference cycles). Every tracked object is
    frozen at exit instead (an atexit handler), so that work is skipped and the kernel takes
    the memory back at once. Every other atexit handler still runs (logging's flush,
    tempfile's clean-up; those registered after this one run before it). What it asks:
    whatever must be closed to be complete is closed before ``main`` returns (atomic writes,
    :mod:`registry.atomic`; a SQLite connection, whose last close removes the -wal and -shm
    files), never left to the collector, as at ``os._exit``.

    Together, a process that trained: 2.8 -> 1.8 CPU s on x86 (``python
    benchmarks/process_start.py``); a torch-free one (``fleetctl``, the job's worker) 0.05-0.1 s
    less; at every step of every job, and more on a Jetson's slower cores. Once per process,
    however often called.
    """
    global _skipping
    if not _skipping:
        _skipping = True
        gen0, gen1, _ = gc.get_threshold()
        gc.set_threshold(gen0, gen1, FULL_COLLECTION_EVERY)
        atexit.register(gc.freeze)


SIGNAL_POLL_S = 0.5
"""How often :func:`wait_for_stop` returns to the interpreter: the most a signal handler's run
can lag its signal."""


def wait_for_stop(stop: threading.Event, poll_s: float = SIGNAL_POLL_S) -> None:
    """Block the main thread until ``stop`` is set (by a SIGTERM or SIGINT handler), waking
    every ``poll_s`` seconds.

    Why not ``stop.wait()``: CPython runs a Python signal handler only in the main thread, when
    it next runs bytecode. The kernel may hand a process's signal to any of its threads (gRPC's,
    ONNX Runtime's, a server's); the C-level handler then only marks it, and a main thread asleep
    in an untimed wait is never woken to look. ``agentctl serve --grpc-port`` so ignored a
    SIGTERM about once in 185 stops on a loaded 2-core host, until its supervisor's SIGKILL
    (systemd's, after TimeoutStopSec). Each timed wake returns to the interpreter, which runs
    the marked handler.
    """
    while not stop.wait(poll_s):
        pass
