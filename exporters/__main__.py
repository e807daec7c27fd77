"""``python -m exporters``: the same job and flags as ``agentctl export``."""

from __future__ import annotations

import argparse
import sys

from exporters.cli import DESCRIPTION, EPILOG, add_export_arguments, run_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m exporters",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_export_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
