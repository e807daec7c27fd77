"""``fleetctl``: inventory, commands and staged rollouts over the agents' MQTT contract.

Exit codes: 0 done / all succeeded, 1 a rollout or a command did not succeed (or the broker
is unreachable), 2 a bad plan or bad arguments (the message names the field).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import ValidationError

from agent.mqtt.contract import COMMAND_TYPES, Status, Topics
from fleet import report as reports
from fleet.broker_config import (
    BrokerConfigError,
    Listener,
    ServerTls,
    load_inventory,
    write_broker_config,
)
from fleet.commands import send
from fleet.controller import Controller, RolloutRun, summarize
from fleet.inventory import Inventory, discover, render_table
from fleet.mqtt import BrokerConfig, FleetConnection
from fleet.plan import PlanError, RolloutPlan, format_errors, load_plan, validate_plan
from fleet.progress import Progress, status_text
from fleet.store import ROLLOUT_ACTIVE, FleetStore

log = logging.getLogger("fleetctl")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments: printed and exit 2."""


# --- set-up ---------------------------------------------------------------------------


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"FLEETCTL_{name}", default)


def _broker(a: argparse.Namespace) -> BrokerConfig:
    try:
        return BrokerConfig(
            host=a.host, port=a.port, prefix=a.prefix, username=a.username,
            password_file=a.password_file, tls_ca=a.tls_ca, tls_cert=a.tls_cert,
            tls_key=a.tls_key,
        )
    except ValidationError as e:
        raise UsageError(format_errors(e, "broker options")) from None


def _membership(a: argparse.Namespace) -> dict[str, list[str]] | None:
    """Device -> groups from ``--inventory`` (the operator's word), or None without one."""
    if a.inventory is None:
        return None
    try:
        inv = load_inventory(Path(a.inventory))
    except BrokerConfigError as e:
        raise UsageError(f"--inventory: {e}") from None
    return {d: entry.groups for d, entry in inv.devices.items()}


def _connect(a: argparse.Namespace, client_id: str, subs: list[str],
             persistent: bool = False) -> FleetConnection:
    conn = FleetConnection(_broker(a), client_id, subs, persistent=persistent)
    conn.start(a.connect_timeout_s)
    return conn


def _controller_id(db: Path) -> str:
    # One stable client id per state db: the broker keeps this controller's session (and the
    # results sent while it was down) across restarts.
    return "fleetctl-" + hashlib.sha1(str(db.resolve()).encode()).hexdigest()[:12]


def _controller_lock(db: Path) -> int | None:
    """An flock beside the db: one controller per db. None when another one holds it."""
    fd = os.open(str(db) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


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


def _setup_logging(a: argparse.Namespace) -> None:
    h = logging.StreamHandler(sys.stderr)
    fmt = a.log_format or ("text" if sys.stderr.isatty() else "json")
    h.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, handlers=[h],
                        force=True)


# --- inventory ------------------------------------------------------------------------


def cmd_devices(a: argparse.Namespace) -> int:
    conn = _connect(a, f"fleetctl-inv-{os.getpid()}", [Topics(a.prefix).all_status()])
    try:
        inv = discover(conn, settle_s=a.settle_s, membership=_membership(a))
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
    membership = _membership(a)
    conn = _connect(a, f"fleetctl-watch-{os.getpid()}", subs)
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


def _read_json_arg(text: str, what: str) -> Any:
    try:
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        return json.loads(text)
    except (OSError, ValueError) as e:
        raise UsageError(f"{what}: not JSON or not readable ({e})") from None


def cmd_send(a: argparse.Namespace) -> int:
    if a.group is not None and a.type is None:  # `send --group G TYPE`: one positional
        a.device, a.type = None, a.device
    if (a.device is None) == (a.group is None):
        raise UsageError("send: give exactly one of DEVICE or --group G")
    if a.type not in COMMAND_TYPES:
        raise UsageError(f"send: unknown TYPE {a.type!r}; known: {', '.join(COMMAND_TYPES)}")
    args = _read_json_arg(a.args, "--args") if a.args else {}
    if not isinstance(args, dict):
        raise UsageError("--args: must be a JSON object")
    t = Topics(a.prefix)
    conn = _connect(a, f"fleetctl-send-{os.getpid()}", [t.all_status(), t.all_results()])
    try:
        if a.group is not None:
            devices = discover(conn, settle_s=a.settle_s,
                               membership=_membership(a)).select(a.group)
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


# --- provisioning ---------------------------------------------------------------------


def cmd_broker_config(a: argparse.Namespace) -> int:
    tls = None
    if a.cafile or a.certfile or a.keyfile:
        if not (a.cafile and a.certfile and a.keyfile):
            raise UsageError("broker-config: --cafile, --certfile and --keyfile go together")
        tls = ServerTls(a.cafile, a.certfile, a.keyfile, a.require_certificate)
    elif a.require_certificate:
        raise UsageError("broker-config: --require-certificate needs --cafile, --certfile, "
                         "--keyfile")
    try:
        summary = write_broker_config(
            load_inventory(a.inventory), a.out, a.secrets, topics=Topics(a.prefix),
            devices=Listener.parse(a.device_listener, "--device-listener"),
            operators=Listener.parse(a.operator_listener, "--operator-listener"), tls=tls,
        )
    except (BrokerConfigError, ValueError) as e:
        raise UsageError(f"broker-config: {e}") from None
    print(json.dumps(summary, indent=1))
    return EXIT_OK


_BROKER_CONFIG_HELP = """\
Write mosquitto's listeners, password files and ACLs for an inventory of devices, so the
broker proves who sent each message (the fleet believes the device id in the topic, never
the payload's).

  devices:                              # INVENTORY (YAML)
    jetson-001: {groups: [line-3, canary]}
    jetson-002: {groups: [line-3]}

Device <id> logs in as <id> on the device listener, where mosquitto replaces every client id
with the account name (use_username_as_clientid): no device can take another's id, kick it
off or wipe its queued commands. It may write only PREFIX/dev/<id>/# and read only its own
commands and those of its groups. Operator tools log in on the operator listener, one account
each: fleet-controller (controller, rollout create), fleet-send (send), fleet-watch (devices,
watch; read only). Packets over 64 KiB + 4 KiB of headers are refused; anonymous clients too.

Passwords: SECRETS/devices/<id>.password and SECRETS/operators/<account>.password are used
when present (0600, 16+ characters), else generated there (0600); a re-run keeps them. Copy a
device's file to its /etc/edge-agent/mqtt.password (mqtt.password_file in agent.yaml). Every
file under OUT is written atomically, 0600: chown them to the broker's user.
"""

_BROKER_CONFIG_EXAMPLE = """\
example:
  fleetctl broker-config --inventory fleet.yaml --out /etc/mosquitto/edgetrain \\
      --secrets /root/edgetrain-secrets --device-listener 8883 \\
      --cafile ca.crt --certfile broker.crt --keyfile broker.key
  chown mosquitto: /etc/mosquitto/edgetrain/*
  mosquitto -c /etc/mosquitto/edgetrain/mosquitto.conf
  fleetctl --port 1884 --tls-ca ca.crt --username fleet-send \\
      --password-file /root/edgetrain-secrets/operators/fleet-send.password \\
      send --group line-3 ping --wait
"""


# --- rollouts -------------------------------------------------------------------------


def _plan_overrides(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in RolloutPlan.model_fields.items():
        v = getattr(a, f"plan_{name}", None)
        if v is None:
            continue
        ann = f.annotation
        if name == "args":
            v = _read_json_arg(v, "--args")
        elif get_origin(ann) is list or list in [get_origin(x) for x in get_args(ann)]:
            v = [p.strip() for p in v.split(",") if p.strip()]
        out[name] = v
    return out


def _plan(a: argparse.Namespace) -> RolloutPlan:
    over = _plan_overrides(a)
    if a.plan is not None:
        return load_plan(a.plan, over)
    return validate_plan(over, "rollout create")


def _run_controller(a: argparse.Namespace, store: FleetStore, conn: FleetConnection,
                    rids: list[str] | None, forever: bool = False) -> dict[str, str]:
    progress = Progress(enabled=not a.quiet)
    ctl = Controller(store, conn, on_progress=progress.update)
    try:
        states = ctl.run(rids, forever=forever)
    finally:
        progress.close()
    for rid in states:
        rep = reports.build(reports.load_run(store, rid))
        paths = reports.write(rep, Path(a.report_dir))
        print(reports.table(rep))
        print(f"report: {paths['json']} {paths['png']}")
    return states


def _exit_code(store: FleetStore, states: dict[str, str]) -> int:
    """0 when every rollout finished its waves with no device failed, or was rolled back
    (on request) with no rollback failed."""
    for rid, state in states.items():
        s = summarize(reports.load_run(store, rid))
        done = state == "succeeded" and not any(w["failed"] for w in s["waves"])
        undone = state == "rolled_back" and s["rollback_failed"] == 0
        if not (done or undone):
            return EXIT_FAILED
    return EXIT_OK


def cmd_rollout_create(a: argparse.Namespace) -> int:
    plan = _plan(a)
    db = Path(a.db)
    store = FleetStore(db)
    lock = None if a.detach else _controller_lock(db)
    t = Topics(a.prefix)
    conn = _connect(a, _controller_id(db) if lock is not None else f"fleetctl-create-{os.getpid()}",
                    [t.all_status(), t.all_results()], persistent=lock is not None)
    try:
        inv = discover(conn, settle_s=a.settle_s, membership=_membership(a))
        targets = inv.select(plan.group, plan.devices)
        if not targets:
            print(f"rollout: no device lists group {plan.group!r}", file=sys.stderr)
            return EXIT_FAILED
        offline = [d for d in targets if d not in inv.devices or inv.devices[d].state != "online"]
        r = store.create_rollout(plan, targets)
        print(json.dumps({"rollout": r.id, "targets": len(targets), "offline": len(offline),
                          "waves": plan.wave_sizes(len(targets))}), flush=True)
        if lock is None:
            if not a.detach:
                print("another controller runs on this db: it takes the rollout over",
                      file=sys.stderr)
            return EXIT_OK
        states = _run_controller(a, store, conn, [r.id])
    finally:
        conn.stop()
    return _exit_code(store, states)


def cmd_controller(a: argparse.Namespace) -> int:
    db = Path(a.db)
    store = FleetStore(db)
    lock = _controller_lock(db)
    if lock is None:
        print(f"another controller holds {db}.lock", file=sys.stderr)
        return EXIT_FAILED
    t = Topics(a.prefix)
    conn = _connect(a, _controller_id(db), [t.all_results()], persistent=True)
    try:
        states = _run_controller(a, store, conn, a.rollout or None, forever=a.forever)
    finally:
        conn.stop()
    return _exit_code(store, states)


def _get_run(store: FleetStore, rid: str) -> RolloutRun:
    try:
        return reports.load_run(store, rid)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None


def cmd_rollout_status(a: argparse.Namespace) -> int:
    store = FleetStore(Path(a.db))
    while True:
        run = _get_run(store, a.id)
        s = summarize(run)
        if a.json:
            print(json.dumps(s, indent=1))
        else:
            if a.follow and sys.stdout.isatty():
                print("\x1b[2J\x1b[H", end="")
            print(status_text(s))
        if not a.follow or s["state"] not in ROLLOUT_ACTIVE:
            return EXIT_OK if s["state"] in ROLLOUT_ACTIVE or s["state"] == "succeeded" \
                else EXIT_FAILED
        time.sleep(a.interval_s)


def cmd_rollout_list(a: argparse.Namespace) -> int:
    store = FleetStore(Path(a.db))
    rows = [{"id": r.id, "state": r.state, "job": r.plan.job,
             "group": r.plan.group or f"{len(r.plan.devices or [])} devices",
             "reason": r.reason, "request": r.request} for r in store.rollouts()]
    print(json.dumps(rows, indent=1) if a.json else
          render_table(rows, ["id", "state", "job", "group", "reason", "request"]))
    return EXIT_OK


def cmd_rollout_request(a: argparse.Namespace) -> int:
    store = FleetStore(Path(a.db))
    _get_run(store, a.id)
    if a.rollout_cmd == "rollback" and store.reopen_for_rollback(a.id):
        print(json.dumps({"rollout": a.id, "state": "rolling_back",
                          "next": "fleetctl controller (or the running one) sends the rollbacks"}))
        return EXIT_OK
    store.post_request(a.id, a.rollout_cmd)
    print(json.dumps({"rollout": a.id, "request": a.rollout_cmd}))
    return EXIT_OK


def cmd_rollout_report(a: argparse.Namespace) -> int:
    store = FleetStore(Path(a.db))
    rep = reports.build(_get_run(store, a.id))
    paths = reports.write(rep, Path(a.report_dir))
    print(reports.table(rep))
    print(f"report: {paths['json']} {paths['png']}")
    return EXIT_OK


# --- parser ---------------------------------------------------------------------------


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    """One flag per plan field, from the model itself: the flags cannot drift from it."""
    for name, f in RolloutPlan.model_fields.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=f"plan_{name}", metavar="VALUE",
                       help=(f.description or "").split("\n")[0].replace("%", "%%"))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fleetctl", description=__doc__.split("\n")[0],
                                 allow_abbrev=False)
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
    ap.add_argument("--db", default=_env("DB", "fleet.db"), help="controller state (SQLite)")
    ap.add_argument("--report-dir", default=_env("REPORT_DIR", "fleet-reports"))
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="quiet time that ends the collection of retained statuses")
    ap.add_argument("--log-format", choices=["text", "json"])
    ap.add_argument("-q", "--quiet", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

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

    p = sub.add_parser("broker-config", help="mosquitto accounts and ACLs for an inventory",
                       description=_BROKER_CONFIG_HELP, epilog=_BROKER_CONFIG_EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inventory", type=Path, required=True, metavar="YAML",
                   help="devices and their groups (format above)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where mosquitto.conf, passwd-* and acl-* go (paths in the conf are "
                        "absolute: write them where the broker reads them)")
    p.add_argument("--secrets", type=Path, required=True, metavar="DIR",
                   help="plain-text passwords, read or generated (keep it off the broker)")
    p.add_argument("--device-listener", default="1883", metavar="[ADDRESS:]PORT",
                   help="where devices connect (default: port 1883 on every interface)")
    p.add_argument("--operator-listener", default="127.0.0.1:1884", metavar="[ADDRESS:]PORT",
                   help="where fleetctl connects (default: 127.0.0.1:1884)")
    p.add_argument("--cafile", type=Path, help="TLS on both listeners: the CA of client "
                   "certificates (with --require-certificate)")
    p.add_argument("--certfile", type=Path, help="the broker's certificate")
    p.add_argument("--keyfile", type=Path, help="the broker's key")
    p.add_argument("--require-certificate", action="store_true",
                   help="devices log in with a client certificate whose CN is their id "
                        "(mutual TLS) instead of a password")
    p.set_defaults(fn=cmd_broker_config)

    p = sub.add_parser("controller", help="drive (resume) every active rollout")
    p.add_argument("--rollout", action="append", help="only these (repeatable)")
    p.add_argument("--forever", action="store_true", help="keep running, take new rollouts")
    p.set_defaults(fn=cmd_controller)

    ro = sub.add_parser("rollout", help="staged rollouts").add_subparsers(
        dest="rollout_cmd", required=True)
    p = ro.add_parser("create", help="create a rollout and drive it (unless --detach)",
                      allow_abbrev=False)
    p.add_argument("--plan", type=Path, help="rollout.yaml; flags override its fields")
    p.add_argument("--detach", action="store_true", help="only create; `fleetctl controller`")
    _add_plan_flags(p)
    p.set_defaults(fn=cmd_rollout_create)
    p = ro.add_parser("status", help="per-wave table with progress bars")
    p.add_argument("id")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--interval-s", type=float, default=1.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_rollout_status)
    p = ro.add_parser("list")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_rollout_list)
    for verb in ("pause", "resume", "abort", "rollback"):
        p = ro.add_parser(verb, help=f"ask the controller to {verb} the rollout")
        p.add_argument("id")
        p.set_defaults(fn=cmd_rollout_request)
    p = ro.add_parser("report", help="write the JSON, table and PNG report again")
    p.add_argument("id")
    p.set_defaults(fn=cmd_rollout_report)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    _setup_logging(a)
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
