"""``fleetctl``: inventory, commands and staged rollouts over the agents' MQTT contract.

Exit codes: 0 done / all succeeded, 1 a rollout or a command did not succeed (a rollout
that completed_with_failures included; or the broker is unreachable), 2 a bad plan or bad
arguments (the message names the field), or a request a rollout can no longer take (pause,
resume or abort of a finished one).

Each command group lives in a module of its own that adds its sub-parsers through
``register(sub)``: ``fleet.cli_devices`` (devices, watch, send), ``fleet.cli_broker``
(broker-config), ``fleet.cli_rollout`` (controller, rollout ...) and ``fleet.cli_learn``
(learn ...); the global options, exit codes and logging they share are ``fleet.cli_options``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from fleet import cli_broker, cli_devices, cli_learn, cli_rollout
from fleet.cli_options import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_global_options,
    setup_logging,
)
from fleet.plan import PlanError

log = logging.getLogger("fleetctl")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fleetctl", description=__doc__.split("\n")[0],
                                 allow_abbrev=False)
    add_global_options(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    cli_devices.register(sub)
    cli_broker.register(sub)
    cli_rollout.register(sub)
    cli_learn.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(a)
    try:
        return int(a.fn(a))
    except (UsageError, PlanError) as e:
        print(f"fleetctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ConnectionError as e:
        print(f"fleetctl: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("fleetctl: interrupted; rollouts keep their state, `fleetctl controller` "
              "resumes them", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
