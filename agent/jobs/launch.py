"""How the job's processes are started: ``python -P -m MODULE`` (torch-free; the daemon uses it).

The worker and each torch child run a module of this package by name, so whatever directory
they start in must never be able to provide that module: ``-P`` (Python 3.11+) keeps the
working directory off ``sys.path``. On 3.10 there is no such flag; there the working directory
is the guard (the daemon starts the worker in its 0700 state dir, the children inherit it).
"""

from __future__ import annotations

import sys


def python_argv(module: str, *args: str) -> list[str]:
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, "-m", module, *args]
