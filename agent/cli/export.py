"""``agentctl export``: run an export job (prune, quantize, export, gate) in the foreground."""

from __future__ import annotations

import argparse

from exporters.cli import DESCRIPTION, EPILOG, add_export_arguments, run_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="prune, quantize to INT8 and export a checkpoint behind accuracy/latency gates",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_export_arguments(p)
    p.set_defaults(func=run_from_args)
