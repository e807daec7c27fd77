"""What every command that drives a db's rollouts shares: one controller per db (an flock
beside it), its stable MQTT session, and, for the commands that create work, the devices it
goes to."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from contract import Topics
from fleet.cli_options import connect, inventory_membership
from fleet.inventory import discover
from fleet.mqtt import FleetConnection


def controller_id(db: Path) -> str:
    # One stable client id per state db: the broker keeps this controller's session (and the
    # results sent while it was down) across restarts.
    return "fleetctl-" + hashlib.sha1(str(db.resolve()).encode()).hexdigest()[:12]


def controller_lock(db: Path) -> int | None:
    """An flock beside the db: one controller per db. None when another one holds it."""
    fd = os.open(str(db) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@dataclass
class Creator:
    """A create command's connection: the controller's own session when it took the db's
    lock (it drives what it creates), else a throwaway one (``--detach``, or another
    controller runs: that one takes the work over)."""

    conn: FleetConnection
    drives: bool


def open_creator(a: argparse.Namespace, kind: str) -> Creator:
    db = Path(a.db)
    lock = None if a.detach else controller_lock(db)
    t = Topics(a.prefix)
    client = controller_id(db) if lock is not None else f"fleetctl-{kind}-{os.getpid()}"
    conn = connect(a, client, [t.all_status(), t.all_results()], persistent=lock is not None)
    return Creator(conn, lock is not None)


def targets_of(a: argparse.Namespace, conn: FleetConnection, group: str | None,
               devices: list[str] | None) -> tuple[list[str], list[str]]:
    """(the devices a plan selects, those of them not online now)."""
    inv = discover(conn, settle_s=a.settle_s, membership=inventory_membership(a))
    targets = inv.select(group, devices)
    offline = [d for d in targets if d not in inv.devices or inv.devices[d].state != "online"]
    return targets, offline
