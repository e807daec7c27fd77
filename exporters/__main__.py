"""``python -m exporters``: the same job and flags as ``agentctl export``."""

from __future__ import annotations

import sys

from exporters.cli import build_parser, run_from_args
from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections


@private_umask()
def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    return run_from_args(build_parser("python -m exporters").parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
