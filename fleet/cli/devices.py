"""``fleetctl devices``, ``watch`` and ``send``: the commands that talk to devices directly,
without a rollout: the inventory from retained status, a live follow of status, events and
telemetry, and one command to a device or a group (``register`` adds their sub-parsers).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from contract import COMMAND_TYPES, Status, Topics
from fleet.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    connect,
    inventory_membership,
    read_json_arg,
)
from fleet.commands import send
from fleet.inventory import Inventory, discover, render_table


def cmd_devices(a: argparse.Namespace) -> int:
    conn = connect(a, f"fleetctl-inv-{os.getpid()}", [Topics(a.prefix).all_status()])
    try:
        inv = discover(conn, settle_s=a.settle_s, membership=inventory_membership(a))
    finally:
        conn.stop()
    rows = inv.rows(a.group)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(render_table(rows, ["device", "state", "conn_seq", "model", "version",
                                  "sequence", "groups", "agent_version"]))
    return EXIT_OK


def cmd_watch(a: argparse.Namespace) -> int:
    t = Topics(a.prefix)
    subs = [t.all_status(), t.all_events()] + ([t.all_telemetry()] if a.telemetry else [])
    membership = inventory_membership(a)
    conn = connect(a, f"fleetctl-watch-{os.getpid()}", subs)
    inv, seen = Inventory(membership), 0
    deadline = time.monotonic() + a.duration_s if a.duration_s else None
    try:
        while (a.count is None or seen < a.count) and (
            deadline is None or time.monotonic() < deadline
        ):
            for m in conn.receive(0.2):
                line: dict[str, Any] | None = None
                if m.kind == "status":
                    st = inv.update(m.device, m.body if isinstance(m.body, Status) else None)
                    if st is not None and (a.group is None or a.group in inv.groups_of(m.device)):
                        line = {"kind": "status", **st.model_dump(mode="json")}
                elif m.body is not None and inv.listed(m.device) and (
                    a.group is None or a.group in inv.groups_of(m.device)
                ):
                    kind = m.kind if m.sub is None else f"{m.kind}/{m.sub}"
                    line = {"kind": kind, "device": m.device, **m.body.model_dump(mode="json")}
                if line is not None:
                    print(json.dumps(line), flush=True)
                    seen += 1
    except KeyboardInterrupt:
        pass
    finally:
        conn.stop()
    return EXIT_OK


def cmd_send(a: argparse.Namespace) -> int:
    if a.group is not None and a.type is None:  # `send --group G TYPE`: one positional
        a.device, a.type = None, a.device
    if (a.device is None) == (a.group is None):
        raise UsageError("send: give exactly one of DEVICE or --group G")
    if a.type not in COMMAND_TYPES:
        raise UsageError(f"send: unknown TYPE {a.type!r}; known: {', '.join(COMMAND_TYPES)}")
    args = read_json_arg(a.args, "--args") if a.args else {}
    if not isinstance(args, dict):
        raise UsageError("--args: must be a JSON object")
    t = Topics(a.prefix)
    conn = connect(a, f"fleetctl-send-{os.getpid()}", [t.all_status(), t.all_results()])
    try:
        if a.group is not None:
            devices = discover(conn, settle_s=a.settle_s,
                               membership=inventory_membership(a)).select(a.group)
            if not devices:
                raise UsageError(f"send: no device lists group {a.group!r}")
        else:
            devices = [a.device]
        try:
            out = send(conn, a.type, args, devices=devices, group=a.group, wait=a.wait,
                       timeout_s=a.timeout_s)
        except ValueError as e:
            raise UsageError(f"send: {e}") from None
        conn.flush()
    finally:
        conn.stop()
    rows = out.rows()
    if a.json:
        print(json.dumps({"id": out.command_id, "results": rows}, indent=1))
    else:
        print(f"command {out.command_id} ({a.type})")
        print(render_table(rows, ["device", "status", "code", "detail"]))
    return EXIT_OK if out.ok(a.wait) else EXIT_FAILED


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="the inventory, from retained status")
    p.add_argument("--group")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_devices)

    p = sub.add_parser("watch", help="follow status, events (and telemetry) live, JSON lines")
    p.add_argument("--group")
    p.add_argument("--telemetry", action="store_true")
    p.add_argument("--count", type=int, help="stop after this many lines")
    p.add_argument("--duration-s", type=float)
    p.set_defaults(fn=cmd_watch)

    p = sub.add_parser("send", help="one command to a device or a group")
    p.add_argument("device", nargs="?")
    p.add_argument("type", nargs="?")
    p.add_argument("--group")
    p.add_argument("--args", help="JSON object or @file")
    p.add_argument("--wait", action="store_true", help="follow to a terminal status")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_send)
