"""``fleetctl rollout ...`` and ``fleetctl controller``: create a rollout from a plan (file
and flags), drive it with the controller (one per state db, held by a lock beside it), show
its status, list rollouts, post pause/resume/abort/rollback/approve requests, and write its
report;
``register`` adds their sub-parsers, one create flag per ``RolloutPlan`` field.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_origin

from fleet.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    field_help,
    inventory_membership,
    positive_seconds,
    read_json_arg,
)
from fleet.cli.session import Session, open_controller, open_creator, targets_of
from fleet.inventory import render_table
from fleet.rollout import operator
from fleet.rollout import report as reports
from fleet.rollout.controller import Controller
from fleet.rollout.plan import RolloutPlan, load_plan, validate_plan
from fleet.rollout.progress import Progress, status_text
from fleet.rollout.run import RolloutRun, summarize
from fleet.rollout.store import ROLLOUT_ACTIVE, FleetStore
from fleet.rollout.verdict import ended_as_asked
from registry.credentials import is_loopback
from registry.validation import field_docs

if TYPE_CHECKING:
    from fleet.rollout.metrics import FleetMetrics


def _plan_overrides(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in RolloutPlan.model_fields.items():
        v = getattr(a, f"plan_{name}", None)
        if v is None:
            continue
        ann = f.annotation
        if name == "args":
            v = read_json_arg(v, "--args")
        elif get_origin(ann) is list or list in [get_origin(x) for x in get_args(ann)]:
            v = [p.strip() for p in v.split(",") if p.strip()]
        out[name] = v
    return out


def _plan(a: argparse.Namespace) -> RolloutPlan:
    over = _plan_overrides(a)
    if a.plan is not None:
        return load_plan(a.plan, over)
    return validate_plan(over, "rollout create")


def _run_controller(a: argparse.Namespace, store: FleetStore, session: Session,
                    rids: list[str] | None, forever: bool = False) -> dict[str, str]:
    progress = Progress(enabled=not a.quiet)
    ctl = Controller(store, session.conn, on_progress=progress.update, replica=session.replica,
                     reask_s=a.reask_s, membership=inventory_membership(a))
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
        if not ended_as_asked(state, summarize(reports.load_run(store, rid))):
            return EXIT_FAILED
    return EXIT_OK


def cmd_rollout_create(a: argparse.Namespace) -> int:
    plan = _plan(a)
    store = FleetStore(a.db)
    creator = open_creator(a, store, "create")
    conn = creator.conn
    try:
        targets, offline = targets_of(a, conn, plan.group, plan.devices)
        if not targets:
            print(f"rollout: no device lists group {plan.group!r}", file=sys.stderr)
            return EXIT_FAILED
        r = store.create_rollout(plan, targets)
        print(json.dumps({"rollout": r.id, "targets": len(targets), "offline": len(offline),
                          "waves": plan.wave_sizes(len(targets))}), flush=True)
        if not creator.drives:
            if not a.detach:
                print("another controller runs on this db: it takes the rollout over",
                      file=sys.stderr)
            return EXIT_OK
        states = _run_controller(a, store, creator.session, [r.id])
    finally:
        conn.stop()
    return _exit_code(store, states)


def cmd_controller(a: argparse.Namespace) -> int:
    if not is_loopback(a.metrics_host) and not a.metrics_allow_remote:
        raise UsageError(f"--metrics-host {a.metrics_host} is not loopback: the metrics name "
                         "every rollout and device state; add --metrics-allow-remote on a "
                         "network you trust")
    store = FleetStore(a.db)
    session = open_controller(a, store)
    if session is None:
        print(f"another controller holds {a.db}.lock", file=sys.stderr)
        return EXIT_FAILED
    metrics = _serve_metrics(a)
    try:
        if a.forever and not a.rollout:
            # The db's controller: its learns' rounds too, not only their rollouts.
            from fleet.cli.learn import drive_learns  # fleet.cli.learn imports this module

            return drive_learns(a, store, session)
        states = _run_controller(a, store, session, a.rollout or None, forever=a.forever)
    finally:
        session.conn.stop()
        if session.replica is not None:
            session.replica.release_all()
        if metrics is not None:
            metrics.close()
    return _exit_code(store, states)


def _serve_metrics(a: argparse.Namespace) -> FleetMetrics | None:
    """GET /metrics of the db's rollouts while this controller runs (``--metrics-port``)."""
    if a.metrics_port is None:
        return None
    from fleet.rollout.metrics import FleetMetrics  # prometheus_client, the HTTP server

    metrics = FleetMetrics(a.db, refresh_s=a.metrics_refresh_s)
    try:
        port = metrics.serve(a.metrics_host, a.metrics_port)
    except OSError as e:
        metrics.close()
        raise UsageError(f"--metrics-port {a.metrics_port}: {e}") from None
    print(json.dumps({"metrics": f"http://{a.metrics_host}:{port}/metrics"}), flush=True)
    return metrics


def _get_run(store: FleetStore, rid: str) -> RolloutRun:
    try:
        return reports.load_run(store, rid)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None


def cmd_rollout_status(a: argparse.Namespace) -> int:
    store = FleetStore(a.db)
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
    store = FleetStore(a.db)
    rows = [{"id": r.id, "state": r.state, "job": r.plan.job,
             "group": r.plan.group or f"{len(r.plan.devices or [])} devices",
             "reason": r.reason, "request": r.request} for r in store.rollouts()]
    print(json.dumps(rows, indent=1) if a.json else
          render_table(rows, ["id", "state", "job", "group", "reason", "request"]))
    return EXIT_OK


def cmd_rollout_request(a: argparse.Namespace) -> int:
    """pause, resume, abort, rollback and approve: checked and posted by
    ``fleet.rollout.operator`` (the dashboard's buttons take the same path)."""
    store = FleetStore(a.db)
    _get_run(store, a.id)
    try:
        out = operator.request(store, a.id, a.rollout_cmd, getattr(a, "wave", None))
    except operator.Refused as e:
        raise UsageError(str(e)) from None
    print(json.dumps(out))
    return EXIT_OK


def cmd_rollout_report(a: argparse.Namespace) -> int:
    store = FleetStore(a.db)
    rep = reports.build(_get_run(store, a.id))
    paths = reports.write(rep, Path(a.report_dir))
    print(reports.table(rep))
    print(f"report: {paths['json']} {paths['png']}")
    return EXIT_OK


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    """One flag per plan field, from the model itself: the flags cannot drift from it. A
    yes/no field's flag alone says yes (``--approve-waves``; ``--approve-waves false`` no);
    ``--rate`` is the other name of ``--max-per-minute`` (one field, one rate)."""
    docs = field_docs(RolloutPlan)
    for name, f in RolloutPlan.model_fields.items():
        flags = ["--" + name.replace("_", "-")] + (["--rate"] if name == "max_per_minute" else [])
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if f.annotation is bool else {}
        p.add_argument(*flags, dest=f"plan_{name}", metavar="VALUE", help=field_help(docs[name]),
                       **extra)


def register(sub: argparse._SubParsersAction) -> None:
    h = ("drive (resume) every active rollout; with --forever every learn too. On a SQLite "
         "--db one controller runs (a lock beside the file); on a PostgreSQL --db any number "
         "of replicas run, each rollout driven by the replica holding its lease (--lease-s), "
         "results shared among them")
    p = sub.add_parser("controller", help=h, description=h)
    p.add_argument("--rollout", action="append", help="only these (repeatable)")
    p.add_argument("--forever", action="store_true",
                   help="keep running, take new rollouts and learns (fleetctl learn)")
    p.add_argument("--hpc-train", metavar="CMD",
                   help="with --forever: how the learns run hpc-train (shell words; default "
                        "$FLEETCTL_HPC_TRAIN, else this Python's -m hpc_core.cli)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics of the db's rollouts on GET /metrics "
                        "(rollouts by state, executions by wave and status, waves, leases; "
                        "0: a free port, printed)")
    p.add_argument("--metrics-refresh-s", type=positive_seconds, default=5.0, metavar="S",
                   help="seconds between two readings of the db for --metrics-port (a scrape "
                        "serves the last one; default 5)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address for --metrics-port (loopback unless --metrics-allow-remote)")
    p.add_argument("--metrics-allow-remote", action="store_true",
                   help="let --metrics-host be a non-loopback address")
    p.set_defaults(fn=cmd_controller)

    ro = sub.add_parser("rollout", help="staged rollouts").add_subparsers(
        dest="rollout_cmd", required=True)
    p = ro.add_parser("create", help="create a rollout and drive it (unless --detach)",
                      allow_abbrev=False)
    p.add_argument("--plan", type=Path, help="rollout.yaml; flags override its fields")
    p.add_argument("--detach", action="store_true", help="only create; `fleetctl controller`")
    _add_plan_flags(p)
    p.set_defaults(fn=cmd_rollout_create)
    h = ("per-wave table with progress bars, then each failed device with its reason (exit 0 "
         "while it is active or once it succeeded, 1 when it ended otherwise)")
    p = ro.add_parser("status", help=h, description=h)
    p.add_argument("id")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--interval-s", type=float, default=1.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_rollout_status)
    p = ro.add_parser("list")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_rollout_list)
    for verb in ("pause", "resume", "abort"):
        h = (f"ask the controller to {verb} a running, paused or waiting rollout (exit 2, "
             "nothing posted, when it is finished or winding down)")
        p = ro.add_parser(verb, help=h, description=h)
        p.add_argument("id")
        p.set_defaults(fn=cmd_rollout_request)
    h = ("let the next wave of an --approve-waves rollout start (it waits in waiting_approval "
         "before each wave after the first); --wave N approves every wave up to N ahead")
    p = ro.add_parser("approve", help=h, description=h)
    p.add_argument("id")
    p.add_argument("--wave", type=int, metavar="N",
                   help="approve waves up to N (as `rollout status` numbers them)")
    p.set_defaults(fn=cmd_rollout_request)
    h = ("abort and roll back a running rollout, or roll back a finished one (rolling_back "
         "again, for the controller)")
    p = ro.add_parser("rollback", help=h, description=h)
    p.add_argument("id")
    p.set_defaults(fn=cmd_rollout_request)
    p = ro.add_parser("report", help="write the JSON, table and PNG report again")
    p.add_argument("id")
    p.set_defaults(fn=cmd_rollout_report)
