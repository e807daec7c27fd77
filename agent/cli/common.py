"""What every agentctl command group shares: the device state arguments and the one error handler.

Command modules register their sub-parsers with ``register(subparsers)`` and wrap their
``run_*`` functions in :func:`guarded`, so a library error always becomes one line on stderr
and a documented exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE_ENV, REGISTRY_ENV = "EDGETRAIN_STATE_DIR", "EDGETRAIN_REGISTRY"
DEFAULT_STATE_DIR = "/var/lib/edge-agent"  # the daemon's default state_dir too

EXIT_CODES = """\
exit codes: 0 done, 1 network or registry failure (retry later), 2 bad arguments or
reference, 3 refused (signature, hash, unsafe name, pickle, spec mismatch: the active model
is untouched), 4 not enough disk, 5 another pull/install holds the state lock
"""


def state_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.state_dir or os.environ.get(STATE_ENV) or DEFAULT_STATE_DIR)


def registry_of(args: argparse.Namespace) -> str | None:
    return args.registry or os.environ.get(REGISTRY_ENV)


def trusted_keys_of(args: argparse.Namespace) -> Any:
    """The trusted keys, checked on disk like the daemon's (``agent.storage.trust``)."""
    from agent.storage.trust import default_trusted_keys, load_trusted

    return load_trusted(
        Path(args.trusted_keys) if args.trusted_keys else default_trusted_keys(state_dir_of(args))
    )


def add_state_args(p: argparse.ArgumentParser, trusted: bool = True) -> None:
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help=f"device state (default: ${STATE_ENV} or {DEFAULT_STATE_DIR})",
    )
    if trusted:
        p.add_argument(
            "--trusted-keys",
            metavar="DIR",
            help="folder of trusted *.pub.pem keys, owned by root or this user and not "
            "group/world-writable (default: STATE_DIR/trusted_keys)",
        )


def fail(code: int, message: str, prog: str = "agentctl") -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def exit_code_of(e: BaseException) -> int | None:
    """The documented exit code of a library error (see EXIT_CODES); None: not ours, re-raise.

    Library errors carry their code (``exit_code``, e.g. registry.errors); plain bad values and
    I/O failures map to 2 and 1."""
    code = getattr(e, "exit_code", None)
    if isinstance(code, int):
        return code
    if isinstance(e, ValueError):
        return 2
    if isinstance(e, OSError):
        return 1
    return None


def describe_error(e: BaseException) -> str:
    code = exit_code_of(e)
    return f"refused ({type(e).__name__}): {e}" if code == 3 else str(e)


def guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Map the library's errors to one-line messages and documented exit codes."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except Exception as e:
            code = exit_code_of(e)
            if code is None:
                raise
            return fail(code, describe_error(e))

    return run
