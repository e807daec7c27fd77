"""``fleetctl learn ...``: start a learn from a plan (file and flags, one flag per
``LearnPlan`` field), drive it (``learn run``: the rollout controller's loop with the learns'
turn in it, one per state db, the same lock as ``fleetctl controller``), show its status,
list learns, resume a failed one and write its report; ``register`` adds the sub-parsers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from fleet.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    field_help,
    inventory_membership,
    read_json_arg,
)
from fleet.cli.session import Session, open_controller, open_creator, targets_of
from fleet.db import is_url
from fleet.inventory import render_table
from fleet.learn import report as learn_report
from fleet.learn.driver import LearnDriver
from fleet.learn.loop import drive
from fleet.learn.plan import LearnPlan, load_learn_plan
from fleet.learn.store import LEARN_FINAL, LearnExists, LearnStore
from fleet.learn.upstream import HPC_TRAIN_ENV, hpc_train_command
from fleet.rollout.controller import Controller
from fleet.rollout.progress import Progress
from fleet.rollout.store import FleetStore
from registry.validation import field_docs

_PATHS = ("trusted_keys", "sign_key", "base_checkpoint", "eval_config", "work_dir")


def _overrides(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"name": a.name}
    for name in LearnPlan.model_fields:
        v = getattr(a, f"plan_{name}", None)
        if v is None:
            continue
        if name == "finetune":
            v = read_json_arg(v, "--finetune")
        elif name in ("devices", "eval_personal"):
            v = [p.strip() for p in v.split(",") if p.strip()]
        out[name] = v
    return out


def _work_root(db: str) -> Path:
    """Where a learn's rounds work by default: beside a SQLite db. A PostgreSQL db has no
    folder: its learns name their ``work_dir`` (one every replica reaches)."""
    if is_url(db):
        raise UsageError("work_dir: a learn on a PostgreSQL --db needs --work-dir (a folder "
                         "every controller replica reaches)")
    return Path(f"{db}.learn").resolve()


def _resolved(plan: LearnPlan, db: str) -> LearnPlan:
    """Absolute paths (``learn run`` may start elsewhere), the work folder fixed, and the
    files the tools need checked now rather than after the first round's fine-tunes."""
    upd: dict[str, Any] = {k: Path(getattr(plan, k)).resolve() for k in _PATHS
                           if getattr(plan, k) is not None}
    if "work_dir" not in upd:
        upd["work_dir"] = _work_root(db) / plan.name
    if "://" not in plan.registry:
        upd["registry"] = str(Path(plan.registry).resolve())
    plan = plan.model_copy(update=upd)
    if not plan.trusted_keys.is_dir():
        raise UsageError(f"trusted_keys: {plan.trusted_keys} is not a folder of *.pub.pem")
    for k in ("sign_key", "base_checkpoint", "eval_config"):
        p = getattr(plan, k)
        if p is not None and not p.exists():
            raise UsageError(f"{k}: {p} does not exist")
    return plan


def _drive(a: argparse.Namespace, store: FleetStore, learns: LearnStore,
           session: Session, learn_ids: list[str] | None, forever: bool = False) -> int:
    ctl = Controller(store, session.conn, replica=session.replica,
                     reask_s=a.reask_s, membership=inventory_membership(a))
    # (Every learn has its work_dir by now: _resolved set it at start.)
    root = Path("fleetctl-learn") if is_url(a.db) else _work_root(a.db)
    driver = LearnDriver(learns, ctl, hpc_train_command(a.hpc_train), root.resolve())
    progress = Progress(enabled=not a.quiet)
    try:
        drive(ctl, driver, learn_ids, forever=forever, on_progress=progress.update)
    finally:
        progress.close()
        for tool in driver.tools.values():
            tool.stop()
    code = EXIT_OK
    for lid in learn_ids or driver.driven:
        s = learn_report.load(store, learns, lid)
        paths = learn_report.write(s, Path(a.report_dir))
        print(learn_report.text(s))
        print(f"report: {paths['json']} {paths['png']}")
        if s["state"] != "finished":
            code = EXIT_FAILED
    return code


def drive_learns(a: argparse.Namespace, store: FleetStore, session: Session) -> int:
    """``fleetctl controller --forever``: every rollout and every running learn, for good."""
    return _drive(a, store, LearnStore(store), session, None, forever=True)


def cmd_learn_start(a: argparse.Namespace) -> int:
    plan = _resolved(load_learn_plan(a.plan, _overrides(a)), a.db)
    store = FleetStore(a.db)
    learns = LearnStore(store)
    if learns.learn(plan.name) is not None:
        raise UsageError(f"learn {plan.name} exists in {store.name}: `fleetctl learn status "
                         f"{plan.name}`, or pick another name")
    creator = open_creator(a, store, "learn")
    conn = creator.conn
    try:
        targets, offline = targets_of(a, conn, plan.group, plan.devices)
        if not targets:
            print(f"learn: no device lists group {plan.group!r}", file=sys.stderr)
            return EXIT_FAILED
        try:
            learn = learns.create(plan, targets)
        except LearnExists as e:
            raise UsageError(str(e)) from None
        print(json.dumps({"learn": learn.id, "targets": len(targets), "offline": len(offline),
                          "rounds": plan.rounds, "base": plan.base,
                          "work_dir": str(plan.work_dir)}), flush=True)
        if not creator.drives:
            if not a.detach:
                print("another controller holds the db lock: it takes the learn over if it "
                      "runs --forever (`fleetctl controller --forever` or `fleetctl learn run "
                      "--forever`)", file=sys.stderr)
            return EXIT_OK
        return _drive(a, store, learns, creator.session, [learn.id])
    finally:
        conn.stop()


def cmd_learn_run(a: argparse.Namespace) -> int:
    store = FleetStore(a.db)
    learns = LearnStore(store)
    for lid in a.names:
        if learns.learn(lid) is None:
            raise UsageError(f"no learn {lid!r} in {store.name}; `fleetctl learn list` shows "
                             "them")
    session = open_controller(a, store)
    if session is None:
        print(f"another controller holds {a.db}.lock", file=sys.stderr)
        return EXIT_FAILED
    try:
        return _drive(a, store, learns, session, a.names or None, forever=a.forever)
    finally:
        session.conn.stop()


def _load(a: argparse.Namespace) -> tuple[FleetStore, LearnStore, dict[str, Any]]:
    store = FleetStore(a.db)
    learns = LearnStore(store)
    try:
        return store, learns, learn_report.load(store, learns, a.name)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None


def cmd_learn_status(a: argparse.Namespace) -> int:
    while True:
        _, _, s = _load(a)
        if a.json:
            print(json.dumps(s, indent=1))
        else:
            if a.follow and sys.stdout.isatty():
                print("\x1b[2J\x1b[H", end="")
            print(learn_report.text(s))
        if not a.follow or s["state"] in LEARN_FINAL:
            return EXIT_FAILED if s["state"] == "failed" else EXIT_OK
        time.sleep(a.interval_s)


def cmd_learn_list(a: argparse.Namespace) -> int:
    learns = LearnStore(FleetStore(a.db))
    rows = [{"id": x.id, "state": x.state, "round": f"{x.round}/{x.plan.rounds}",
             "base": x.base, "model": x.plan.model,
             "group": x.plan.group or f"{len(x.plan.devices or [])} devices",
             "reason": x.reason} for x in learns.learns()]
    print(json.dumps(rows, indent=1) if a.json else
          render_table(rows, ["id", "state", "round", "base", "model", "group", "reason"]))
    return EXIT_OK


def cmd_learn_report(a: argparse.Namespace) -> int:
    _, _, s = _load(a)
    paths = learn_report.write(s, Path(a.report_dir))
    print(learn_report.text(s))
    print(f"report: {paths['json']} {paths['png']}")
    return EXIT_OK


def cmd_learn_resume(a: argparse.Namespace) -> int:
    _, learns, _ = _load(a)
    learn = learns.learn(a.name)
    assert learn is not None
    if learn.state != "failed":
        raise UsageError(f"learn {a.name} is {learn.state}: only a failed learn is resumed")
    learns.set_state(learn, "running")
    print(json.dumps({"learn": a.name, "state": "running", "round": learn.round,
                      "next": "fleetctl learn run (or the running one) goes on"}))
    return EXIT_OK


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    """One flag per plan field, from the model itself (the name is the positional NAME)."""
    docs = field_docs(LearnPlan)
    for name, f in LearnPlan.model_fields.items():
        if name == "name":
            continue
        flag = "--" + name.replace("_", "-")
        h = field_help(docs[name])
        if f.annotation is bool:
            p.add_argument(flag, dest=f"plan_{name}", action="store_const", const=True, help=h)
        else:
            p.add_argument(flag, dest=f"plan_{name}", metavar="VALUE", help=h)


def _add_tool_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hpc-train", metavar="CMD",
                   help=f"how to run hpc-train (shell words; default ${HPC_TRAIN_ENV}, else "
                        "the hpc-train beside this Python)")


EPILOG = """\
a round: fine-tune (upload) -> collect uploads -> hpc-train aggregate -> publish the
candidate (PREFIX-rK-candidate) -> evaluate it on every device -> publish the release
(PREFIX-rK) behind the device gates (exit 4 of publish: refused, the base is kept) ->
[deploy it] -> the next round from the release.

examples:
  fleetctl learn start nightly --group line-3 --model digits-cnn --base 3 --rounds 5 \\
      --data cam0 --registry /srv/registry --trusted-keys keys/trusted \\
      --sign-key keys/upstream.key.pem --min-updates 8 --max-staleness 1 --collect-s 1800 \\
      --strategy trimmed-mean --trim 0.1 --min-devices 8 --max-device-drop 2 \\
      --min-mean-gain 0.5 --deploy --waves 1,25%,100%
  fleetctl learn start nightly --plan learn.yaml       # flags override the file
  fleetctl learn status nightly [--json] [--follow]
  fleetctl learn run [nightly] [--forever]             # resume after a crash or a reboot
"""


def register(sub: argparse._SubParsersAction) -> None:
    lp = sub.add_parser("learn", help="rounds of fleet learning (fine-tune, aggregate, "
                        "evaluate, publish behind gates)", description=__doc__.split("\n")[0],
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ls = lp.add_subparsers(dest="learn_cmd", required=True)
    p = ls.add_parser("start", help="start a learn and drive it (unless --detach)",
                      allow_abbrev=False)
    p.add_argument("name", help="the learn's name (its rollouts: NAME-rK-ft|ev|dp)")
    p.add_argument("--plan", type=Path, help="learn.yaml; flags override its fields")
    p.add_argument("--detach", action="store_true", help="only create; `fleetctl learn run`")
    _add_tool_flag(p)
    _add_plan_flags(p)
    p.set_defaults(fn=cmd_learn_start)
    p = ls.add_parser("run", help="drive (resume) learns and every active rollout of the db")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these (default: every "
                   "running learn)")
    p.add_argument("--forever", action="store_true", help="keep running, take new learns")
    _add_tool_flag(p)
    p.set_defaults(fn=cmd_learn_run)
    h = ("rounds so far (updates used/skipped/dropped, evaluations, gate figures, releases) and "
         "where the current one is (exit 1 when the learn failed)")
    p = ls.add_parser("status", help=h, description=h)
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--interval-s", type=float, default=2.0)
    p.set_defaults(fn=cmd_learn_status)
    p = ls.add_parser("list")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_learn_list)
    p = ls.add_parser("report", help="write the JSON and the accuracy-per-round PNG")
    p.add_argument("name")
    p.set_defaults(fn=cmd_learn_report)
    h = "a failed learn runs again from the phase it stopped in (once its cause is fixed)"
    p = ls.add_parser("resume", help=h, description=h)
    p.add_argument("name")
    p.set_defaults(fn=cmd_learn_resume)
