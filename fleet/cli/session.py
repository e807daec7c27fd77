"""What every command that drives a db's rollouts shares: who may drive (one controller per
SQLite file, an flock beside it; any number of replicas on a PostgreSQL db, each rollout
leased to one), its MQTT session, and, for the commands that create work, the devices it goes
to.

SQLite: the controller's session is persistent under one stable client id per db, so results
sent while it was down wait for it. PostgreSQL: every replica joins the shared subscription
``$share/fleetctl/...`` with a session that ends with its connection — mosquitto keeps
queueing a shared subscription's messages to a disconnected persistent session, which would
hold a dead replica's share of the results away from the live ones. A result sent while no
replica is connected is recovered by the re-send of every open execution when a replica
takes its rollout (the device answers DUPLICATE with where it stands).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from contract import Topics
from fleet.cli.options import connect, inventory_membership
from fleet.db import is_url, redact
from fleet.inventory import discover
from fleet.mqtt import FleetConnection
from fleet.rollout.replicas import SHARE_GROUP, Replica, replica_name
from fleet.rollout.store import FleetStore


def controller_id(db: str | Path) -> str:
    # One stable client id per state db: the broker keeps this controller's session (and the
    # results sent while it was down) across restarts.
    key = redact(db) if is_url(db) else str(Path(db).resolve())
    return "fleetctl-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def controller_lock(db: Path) -> int | None:
    """An flock beside a SQLite db: one controller per db. None when another one holds it."""
    fd = os.open(str(db) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@dataclass
class Session:
    """A controller's connection; ``replica`` when the db is PostgreSQL."""

    conn: FleetConnection
    replica: Replica | None = None


def open_controller(a: argparse.Namespace, store: FleetStore,
                    extra_subs: tuple[str, ...] = ()) -> Session | None:
    """The session of a process that drives the db's rollouts (``controller``, ``learn
    run``, a ``create`` that drives what it creates). None: a SQLite db's lock is taken."""
    t = Topics(a.prefix)
    # Statuses too: a follow_group rollout takes the devices that join its group.
    extra_subs = tuple(dict.fromkeys((*extra_subs, t.all_status())))
    if is_url(a.db):
        name = replica_name()
        subs = [*extra_subs, f"$share/{SHARE_GROUP}/{t.all_results()}"]
        conn = connect(a, f"{controller_id(a.db)}-{name}", subs, persistent=False)
        return Session(conn, Replica(store.db, name, a.lease_s))
    if controller_lock(Path(a.db)) is None:
        return None
    subs = [*extra_subs, t.all_results()]
    return Session(connect(a, controller_id(a.db), subs, persistent=True))


@dataclass
class Creator:
    """A create command's connection: the controller's own session when it may drive what it
    creates, else a throwaway one (``--detach``, or another controller holds a SQLite db's
    lock: that one takes the work over)."""

    session: Session
    drives: bool

    @property
    def conn(self) -> FleetConnection:
        return self.session.conn


def open_creator(a: argparse.Namespace, store: FleetStore, kind: str) -> Creator:
    t = Topics(a.prefix)
    if not a.detach:
        session = open_controller(a, store, (t.all_status(),))
        if session is not None:
            return Creator(session, True)
    conn = connect(a, f"fleetctl-{kind}-{os.getpid()}", [t.all_status(), t.all_results()])
    return Creator(Session(conn), False)


def targets_of(a: argparse.Namespace, conn: FleetConnection, group: str | None,
               devices: list[str] | None) -> tuple[list[str], list[str]]:
    """(the devices a plan selects, those of them not online now)."""
    inv = discover(conn, settle_s=a.settle_s, membership=inventory_membership(a))
    targets = inv.select(group, devices)
    offline = [d for d in targets if d not in inv.devices or inv.devices[d].state != "online"]
    return targets, offline
