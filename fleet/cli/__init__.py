"""``fleetctl``: inventory, commands and staged rollouts over the agents' MQTT contract.

Exit codes: 0 done / all succeeded, 1 a rollout or a command did not succeed (a rollout
that completed_with_failures included; or the broker is unreachable), 2 a bad plan or bad
arguments (the message names the field), or a request a rollout can no longer take (pause,
resume or abort of a finished one).

Each command group lives in a module of its own that adds its sub-parsers through
``register(sub)``: ``fleet.cli.devices`` (devices, watch, send), ``fleet.cli.broker``
(broker-config), ``fleet.cli.rollout`` (controller, rollout ...), ``fleet.cli.learn`` (learn
...) and ``fleet.cli.dashboard`` (dashboard: the web page of ``fleet.dashboard``); the global
options, exit codes and logging they share are ``fleet.cli.options``, and who may drive a
db's rollouts and learns (the lock, the replicas' session, the devices a create goes to) is
``fleet.cli.session``.

The package owns the command line only: parsing, printing, exit codes. It is the top of the
fleet and may import every other part of it (``fleet.rollout``, ``fleet.learn``,
``fleet.broker`` and the shared ``fleet.db``, ``fleet.mqtt``, ``fleet.inventory``,
``fleet.commands``) but never ``fleet.sim``, the simulated devices; nothing in ``fleet``
imports it (``pyproject.toml``, ``[tool.importlinter]``). ``python -m fleet.cli`` runs it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from fleet.cli import broker, dashboard, devices, learn, rollout
from fleet.cli.options import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_global_options,
    setup_logging,
)
from fleet.rollout.plan import PlanError
from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections

log = logging.getLogger("fleetctl")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fleetctl", description=__doc__.split("\n")[0],
                                 allow_abbrev=False)
    add_global_options(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    devices.register(sub)
    broker.register(sub)
    rollout.register(sub)
    learn.register(sub)
    dashboard.register(sub)
    return ap


@private_umask()
def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
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

