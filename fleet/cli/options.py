"""What every ``fleetctl`` command shares: the global options (broker, ``--inventory``,
``--db``, logging; each with its ``FLEETCTL_*`` environment default) and what they become (a
broker connection, the operator's group membership, the log handler), JSON arguments given
inline or as ``@file``, and the exit codes with ``UsageError``, the bad-arguments error every
command raises.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fleet.broker.config import BrokerConfigError, load_inventory
from fleet.mqtt import BrokerConfig, FleetConnection
from fleet.rollout.plan import format_errors

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments: printed and exit 2."""


def field_help(doc: str) -> str:
    """A plan field's whole description (``registry.validation.field_docs``) as its flag's
    help: argparse re-wraps it, so the description's own line breaks go (its first line alone
    stops mid-sentence)."""
    return " ".join(doc.split()).replace("%", "%%")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"FLEETCTL_{name}", default)


def broker_config(a: argparse.Namespace) -> BrokerConfig:
    """The broker options as a ``BrokerConfig`` (a bad one: ``UsageError``)."""
    return _broker(a)


def _broker(a: argparse.Namespace) -> BrokerConfig:
    try:
        return BrokerConfig(
            host=a.host, port=a.port, prefix=a.prefix, username=a.username,
            password_file=a.password_file, tls_ca=a.tls_ca, tls_cert=a.tls_cert,
            tls_key=a.tls_key,
        )
    except ValidationError as e:
        raise UsageError(format_errors(e, "broker options")) from None


def inventory_membership(a: argparse.Namespace) -> dict[str, list[str]] | None:
    """Device -> groups from ``--inventory`` (the operator's word), or None without one."""
    if a.inventory is None:
        return None
    try:
        inv = load_inventory(Path(a.inventory))
    except BrokerConfigError as e:
        raise UsageError(f"--inventory: {e}") from None
    return {d: entry.groups for d, entry in inv.devices.items()}


def connect(a: argparse.Namespace, client_id: str, subs: list[str],
            persistent: bool = False) -> FleetConnection:
    conn = FleetConnection(_broker(a), client_id, subs, persistent=persistent)
    conn.start(a.connect_timeout_s)
    return conn


def read_json_arg(text: str, what: str) -> Any:
    try:
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        return json.loads(text)
    except (OSError, ValueError) as e:
        raise UsageError(f"{what}: not JSON or not readable ({e})") from None


def _seconds(text: str) -> float:
    """A duration of 1 s or more (a lease or a re-ask period under that would have every
    replica take every rollout, or flood the devices)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of seconds") from None
    if not v >= 1.0:
        raise argparse.ArgumentTypeError(f"{text}: at least 1 second")
    return v


def positive_seconds(text: str) -> float:
    """A duration over 0 s (a refresh period)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of seconds") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text}: more than 0 seconds")
    return v


def add_global_options(ap: argparse.ArgumentParser) -> None:
    """The options before the command, each defaulting to its ``FLEETCTL_*`` variable."""
    g = ap.add_argument_group("broker (or FLEETCTL_HOST, _PORT, _PREFIX, ... in the environment)")
    g.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    g.add_argument("--port", type=int, default=int(_env("PORT", "1883") or 1883))
    g.add_argument("--prefix", default=_env("PREFIX", "fleet/v1"))
    g.add_argument("--username", default=_env("USERNAME"))
    g.add_argument("--password-file", type=Path, default=_env("PASSWORD_FILE"))
    g.add_argument("--tls-ca", type=Path, default=_env("TLS_CA"))
    g.add_argument("--tls-cert", type=Path, default=_env("TLS_CERT"))
    g.add_argument("--tls-key", type=Path, default=_env("TLS_KEY"))
    g.add_argument("--connect-timeout-s", type=float, default=10.0,
                   help="give up when no CONNACK arrives in this time (a refused TLS "
                        "handshake shows only as silence)")
    ap.add_argument("--inventory", default=_env("INVENTORY"), metavar="FILE",
                    help="the operator's inventory (the file broker-config reads): groups come "
                         "from it, not from what a device's status claims, and a device it "
                         "does not list is ignored")
    ap.add_argument("--db", default=_env("DB", "fleet.db"),
                    help="controller state: a SQLite file (one controller), or a PostgreSQL "
                         "URL postgresql://USER@HOST:PORT/DB shared by controller replicas "
                         "(the password from ~/.pgpass or PGPASSWORD, never the command line)")
    ap.add_argument("--lease-s", type=_seconds, default=15.0,
                    help="PostgreSQL --db: how long a replica that stops renewing keeps its "
                         "rollouts before another takes them over")
    ap.add_argument("--reask-s", type=_seconds, default=30.0,
                    help="send an open execution again (same id) when nothing was heard of "
                         "it for this long: the device answers where it stands")
    ap.add_argument("--report-dir", default=_env("REPORT_DIR", "fleet-reports"))
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="quiet time that ends the collection of retained statuses")
    ap.add_argument("--log-format", choices=["text", "json"])
    ap.add_argument("-q", "--quiet", action="store_true")


_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _extras(r: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(r).items() if k not in _RECORD_FIELDS}


class _JsonFormatter(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        out = {"ts": round(r.created, 3), "level": r.levelname.lower(), "logger": r.name,
               "msg": r.getMessage()}
        out.update(_extras(r))
        return json.dumps(out, default=str)


class _TextFormatter(logging.Formatter):
    """The message, then its fields as key=value: for a person reading a log."""

    def format(self, r: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v if v is not None else '-'}" for k, v in _extras(r).items())
        return f"{r.getMessage()} {fields}".rstrip()


def setup_logging(a: argparse.Namespace) -> None:
    h = logging.StreamHandler(sys.stderr)
    fmt = a.log_format or ("text" if sys.stderr.isatty() else "json")
    h.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, handlers=[h],
                        force=True)
