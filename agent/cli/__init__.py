"""agentctl: drive the edge agent on a device, or run one of its jobs in the foreground.

Each command group lives in its own module under ``agent/cli/`` and registers its
sub-parsers through ``register(subparsers)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections

# Command modules, in the order they appear in --help.
COMMAND_MODULES = (
    "agent.cli.models",
    "agent.cli.serve",
    "agent.cli.finetune",
    "agent.cli.jobs",
    "agent.cli.export",
    "agent.cli.sensors",
    "agent.cli.daemon",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentctl",
        description="Pull, fine-tune, export and inspect models on an edgetrain device.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency inside the module: surface it
                raise
            continue
        module.register(sub)
    return parser


@private_umask()
def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
