"""Expensive fixture outputs built once per test run, however many pytest-xdist workers ask.

A session-scoped fixture runs once per *process*: under ``make test`` (``pytest -n 2 --dist
loadfile``) two workers whose files both use it each build it, a detector trained for ~30 s
of CPU twice. pytest-xdist's documented recipe for fixtures that must run once: build into
the run's shared temporary root (the parent of every worker's basetemp) under a file lock;
the first worker to ask builds, the others wait and then read what it built. Only for
outputs the tests read and never change: a test copies what it will write into.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

DONE = ".built"
"""Written last: a folder without it is a build that died half way, and is built again."""


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], object]) -> Path:
    """The folder ``name`` that ``build(folder)`` filled, built by the first process of this
    run to ask (the folder exists, empty, when ``build`` is called)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / f"once-{name}"
    with FileLock(str(root / f"once-{name}.lock")):
        if not (out / DONE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (out / DONE).touch()
    return out
