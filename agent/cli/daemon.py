"""agentctl commands that talk to the running ``edge-agent`` over its control socket.

The daemon's ``control_socket`` (``--socket``, ``$EDGE_AGENT_SOCKET``, else STATE_DIR/agent.sock
or /run/edge-agent/agent.sock; root, the service user and the admin group only), the MQTT
command schema, no broker needed: ``status``, ``cancel``, ``deploy``, ``logs``, ``send`` (any
contract command, e.g. rollback or set_power_mode, through the daemon's queue), and
``finetune --daemon`` / ``finetune --follow``, which submit the device job to the daemon
instead of running it here. What goes through the daemon is a command like any other: names
and numbers only (``--data cam0`` is DATA_ROOT/cam0), the registry, keys and paths are the
daemon's own (agent.yaml).

Without a daemon the foreground commands work as before (``agentctl finetune`` runs the job
in this process, ``agentctl jobs``/``job`` read the store); ``cancel`` then flags the job in
the store (the process running it stops at its next step) and ``logs`` reads the log file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.cli.common import add_state_args, fail, state_dir_of

SOCKET_NAME = "agent.sock"
SOCKET_ENV = "EDGE_AGENT_SOCKET"
RUN_SOCKET = Path("/run/edge-agent/agent.sock")
"""Where the systemd unit's example config puts it (RuntimeDirectory, enterable by the group)."""
TRUST_FLAGS = {("registry",): "--registry", ("trusted_keys",): "--trusted-keys",
               ("signing_key",): "--signing-key", ("upload", "registry"): "--upload-to",
               ("export", "tensorrt", "timing_cache"): "--trt-timing-cache"}
"""Foreground-only flags: the daemon takes these from agent.yaml (or resolves a name)."""
TERMINAL = {"REJECTED", "EXPIRED", "SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}

EPILOG = """\
These talk to the edge-agent daemon over its control socket (--socket, $EDGE_AGENT_SOCKET,
else STATE_DIR/agent.sock, else /run/edge-agent/agent.sock; the broker may be unreachable).
Without a daemon: cancel flags the job in the store, logs reads the file, status/deploy/send
fail with exit 3.

A command sent here carries what an MQTT command may: model, version, job knobs and names
(--data cam0 = the daemon's data_root/cam0). Where to pull from and upload to, what to trust
and what to sign with are the daemon's (agent.yaml), never the command's.

examples:
  agentctl status --state-dir /var/lib/edge-agent
  agentctl finetune --model digits --data cam0 --follow      # through the daemon
  agentctl deploy digits 7 --data cam0 --follow              # from agent.yaml's registry.url
  agentctl deploy digits 8 --data cam0 --personal head       # the fleet's release, own head
  agentctl send rollback --args '{"name": "digits", "reason": "drill"}' --follow
  agentctl cancel ft-20261123T0500Z ; agentctl logs ft-20261123T0500Z -n 100

exit codes: 0 done (the command SUCCEEDED or was ACCEPTED), 1 it ended otherwise, 2 REJECTED
or bad arguments, 3 no daemon listening
"""


def socket_of(args: argparse.Namespace) -> Path:
    if getattr(args, "socket", None):
        return Path(args.socket)
    if os.environ.get(SOCKET_ENV):
        return Path(os.environ[SOCKET_ENV])
    in_state = state_dir_of(args) / SOCKET_NAME
    return RUN_SOCKET if not in_state.is_socket() and RUN_SOCKET.is_socket() else in_state


def daemon_up(args: argparse.Namespace) -> bool:
    return socket_of(args).is_socket()


def _ask(args: argparse.Namespace, req: dict[str, Any],
         timeout_s: float | None = 30.0) -> Iterator[dict[str, Any]]:
    from agent.daemon.control import request

    return request(socket_of(args), req, timeout_s)


def _no_daemon(args: argparse.Namespace, what: str) -> int:
    return fail(3, f"{what}: no edge-agent listening at {socket_of(args)} (is the service "
                "running, and is --state-dir its state_dir?)")


def envelope(type_: str, args: dict[str, Any], *, id: str | None = None,
             timeout_s: float | None = None) -> dict[str, Any]:
    cmd: dict[str, Any] = {"v": 1, "id": id or f"ctl-{uuid.uuid4().hex[:12]}", "type": type_,
                           "issued_at": datetime.now(timezone.utc).isoformat(), "args": args}
    if timeout_s:
        cmd["timeout_s"] = timeout_s
    return cmd


# -- sending a command and following it --------------------------------------------------------


def send_command(args: argparse.Namespace, cmd: dict[str, Any], *, follow: bool,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Send ``cmd`` through the socket; print each result (``--json``: as is) unless
    ``on_result`` takes them; the exit code from the last status."""
    last: dict[str, Any] | None = None
    try:
        for obj in _ask(args, {"op": "command", "command": cmd, "follow": follow},
                        timeout_s=None if follow else 30.0):
            if "error" in obj:
                return fail(1, f"{cmd['type']}: the daemon answered: {obj['error']}")
            if "result" in obj:
                last = obj["result"]
                (on_result or _print_result(args))(last)
    except OSError:
        return _no_daemon(args, cmd["type"])
    if last is None:
        return fail(1, f"{cmd['type']}: no result from the daemon")
    status = last.get("stored_status") if last["status"] == "DUPLICATE" else last["status"]
    if status in ("REJECTED", "EXPIRED"):
        return 2
    return 0 if status in ("SUCCEEDED", "ACCEPTED", "IN_PROGRESS") else 1


def _print_result(args: argparse.Namespace) -> Callable[[dict[str, Any]], None]:
    def show(r: dict[str, Any]) -> None:
        if getattr(args, "json", False):
            print(json.dumps(r, sort_keys=True))
            return
        line = f"{r['id']}: {r['status']}"
        if r.get("stored_status"):
            line += f" (stored {r['stored_status']})"
        p = r.get("progress") or {}
        if p:
            line += f" {p.get('stage')}" + (f" {p['step']}/{p.get('total')}" if p.get("step")
                                            is not None else "")
        if r.get("error"):
            line += f" {r['error']['code']}: {r['error']['message']}"
        print(line, file=sys.stderr if r["status"] == "IN_PROGRESS" else sys.stdout)
        if r.get("result") and r["status"] != "DUPLICATE":
            print(json.dumps(r["result"], sort_keys=True))
    return show


def follow_job(args: argparse.Namespace, cmd: dict[str, Any], progress: str) -> int:
    """Submit a job and show the device job's own progress display (fed by the job store the
    daemon's worker writes), then its summary, as ``agentctl finetune`` does in the
    foreground."""
    from agent.jobs.display import ProgressDisplay, print_rows, summary_rows
    from agent.jobs.store import JobStore

    state_dir = state_dir_of(args)
    with JobStore(state_dir) as store:
        mode = None if progress == "auto" else progress
        stage = {"name": ""}
        with ProgressDisplay(store, cmd["id"], mode) as display:  # type: ignore[arg-type]
            def on_result(r: dict[str, Any]) -> None:
                st = (r.get("progress") or {}).get("stage")
                if st and st != stage["name"]:
                    stage["name"] = st
                    display.on_event(st, {"status": "started"})
                if r["status"] in ("REJECTED", "EXPIRED", "DUPLICATE"):
                    _print_result(args)(r)

            code = send_command(args, cmd, follow=True, on_result=on_result)
        rec = store.get(cmd["id"])
        if rec is None or code in (2, 3):
            return code
        print_rows(summary_rows(rec, store.steps(cmd["id"])))
        print(json.dumps({"job": rec.id, "state": rec.state.value, "result": rec.result,
                          "error": rec.error}, sort_keys=True))
        return 0 if rec.state.value == "SUCCEEDED" else 1


# -- commands ----------------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    try:
        st = next(iter(_ask(args, {"op": "status"})))["status"]
    except OSError:
        return _no_daemon(args, "status")
    if args.json:
        print(json.dumps(st, sort_keys=True))
        return 0
    model = st.get("model") or {}
    job = st.get("job") or {}
    rows = [("device", f"{st['device']} (agent {st['agent_version']})"),
            ("broker", f"connected, conn_seq {st['conn_seq']}" if st["connected"]
             else "not connected (results wait in the outbox)"),
            ("model", f"{model['name']}@{model['version']} slot {model.get('slot')}" if model
             else "none installed"),
            ("job", f"{job['id']} {job.get('stage')} {job.get('pct') or ''}".strip() if job
             else "idle"),
            ("queued", ", ".join(st["queued"]) or "-"),
            ("outbox", f"{st['outbox']} message(s) to deliver")]
    for k, v in rows:
        print(f"{k:<8} {v}")
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    if daemon_up(args):
        return send_command(args, envelope("cancel", {"job_id": args.job_id}), follow=False)
    from agent.jobs.store import JobStore

    state_dir = state_dir_of(args)
    if not (state_dir / "jobs.db").is_file():
        return fail(1, f"cancel: no job {args.job_id!r} in {state_dir / 'jobs.db'}")
    with JobStore(state_dir) as store:
        rec = store.get(args.job_id)
        if rec is None:
            return fail(1, f"cancel: no job {args.job_id!r} in {state_dir / 'jobs.db'}")
        if rec.terminal:
            return fail(1, f"cancel: job {args.job_id!r} already ended {rec.state.value}")
        store.request_cancel(args.job_id)
    print(f"{args.job_id}: cancel requested (no daemon: the process running the job stops "
          "at its next step)")
    return 0


def run_deploy(args: argparse.Namespace) -> int:
    spec: dict[str, Any] = {"model": args.model, "version": args.version}
    if args.data:
        spec["data"] = args.data
    if args.personal:
        spec["personal"] = args.personal
    cmd = envelope("deploy", spec, id=args.id, timeout_s=args.timeout_s)
    if args.follow:
        return follow_job(args, cmd, args.progress)
    return send_command(args, cmd, follow=False)


def run_send(args: argparse.Namespace) -> int:
    try:
        cmd_args = json.loads(args.args)
    except ValueError as e:
        return fail(2, f"send: --args is not JSON: {e}")
    if not isinstance(cmd_args, dict):
        return fail(2, "send: --args must be a JSON object")
    cmd = envelope(args.type, cmd_args, id=args.id, timeout_s=args.timeout_s)
    return send_command(args, cmd, follow=args.follow)


def run_logs(args: argparse.Namespace) -> int:
    from agent.daemon.control import read_log

    try:
        lines = next(iter(_ask(args, {"op": "logs", "job_id": args.job_id,
                                      "lines": args.lines})))["lines"]
    except OSError:  # no daemon: the same file, read here
        lines = read_log(state_dir_of(args) / "logs", args.job_id, args.lines)
    for line in lines:
        print(line)
    return 0


def finetune_through_daemon(foreground: Callable[[argparse.Namespace], int]) -> Callable[
        [argparse.Namespace], int]:
    """``agentctl finetune``'s entry point: with --daemon or --follow the job goes to the
    daemon's queue (same spec, same checks); otherwise ``foreground`` runs it here."""

    def run(args: argparse.Namespace) -> int:
        if not (args.daemon or args.follow):
            return foreground(args)
        if args.resume:
            return fail(2, "finetune: --resume runs a stored job here; the daemon resumes "
                        "its own jobs (drop --daemon/--follow)")
        from agent.jobs.spec import FinetuneArgs
        from hpc_core.config import ConfigError
        from hpc_core.job_args import job_tree, validate_job

        tree = job_tree(args)
        for path, name in TRUST_FLAGS.items():
            if _dig(tree, path) is not None:
                return fail(2, f"finetune --daemon/--follow: {name} is the daemon's own "
                            "(agent.yaml): a command carries no registry, key or path; drop "
                            "it, or run the job here without --daemon/--follow")
        if not daemon_up(args):
            return _no_daemon(args, "finetune --daemon/--follow")
        try:
            spec = validate_job(FinetuneArgs, tree, "finetune command")
        except ConfigError as e:
            return fail(2, f"finetune: {' '.join(str(e).split())[:400]}")
        job_id = args.job_id or "ft-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        # Only what was given: the daemon fills in the rest (its board's profile, sensors).
        cmd = envelope("finetune", spec.model_dump(mode="json", exclude_unset=True),
                       id=job_id, timeout_s=args.timeout_s)
        if args.follow:
            return follow_job(args, cmd, args.progress)
        return send_command(args, cmd, follow=False)

    return run


def _dig(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(k)  # type: ignore[assignment]
    return tree


# -- registration ------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_state_args(p, trusted=False)
        _socket_flag(p)
        return p

    p = add("status", "the running daemon: broker link, active model, job, queue, outbox")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_status)
    p = add("cancel", "cancel a queued or running job (through the daemon when it runs)")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_cancel)
    p = add("deploy", "pull, stage, check and commit a version of the daemon's registry "
            "(registry.url in agent.yaml)")
    p.add_argument("model")
    p.add_argument("version")
    p.add_argument("--data", metavar="NAME",
                   help="held-out data set for the health check: a name under the daemon's "
                   "data_root")
    p.add_argument("--personal", action="append", choices=["head", "norm"], default=[],
                   help="personalized serving: keep this part of the device's own (active) "
                   "model in the version deployed; the device signs the result as its own "
                   "version of it (repeat for both)")
    _job_flags(p)
    p.set_defaults(func=run_deploy)
    p = add("send", "send any contract command to the daemon (same schema as MQTT)")
    p.add_argument("type", help="ping, status, rollback, cancel, set_power_mode, ...")
    p.add_argument("--args", default="{}", help="the command's args as a JSON object")
    _job_flags(p)
    p.set_defaults(func=run_send)
    p = add("logs", "a job's worker log (through the daemon, or the file without one)")
    p.add_argument("job_id")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.set_defaults(func=run_logs)
    # agentctl finetune (agent/cli/finetune.py, registered earlier) gains the daemon path.
    ft = sub.choices.get("finetune")
    if ft is not None:
        g = ft.add_argument_group("through the running daemon")
        g.add_argument("--daemon", action="store_true",
                       help="submit the job to the running edge-agent and return once queued")
        g.add_argument("--follow", action="store_true",
                       help="submit it to the daemon and show its progress to the end")
        _socket_flag(g)
        ft.set_defaults(func=finetune_through_daemon(ft.get_default("func")))


def _socket_flag(p: argparse._ActionsContainer) -> None:
    p.add_argument("--socket", metavar="PATH",
                   help=f"the daemon's control socket (default: ${SOCKET_ENV}, else "
                   f"STATE_DIR/{SOCKET_NAME}, else {RUN_SOCKET})")


def _job_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", help="command id, the idempotency key: 1-128 of A-Z a-z 0-9 . _ : -, "
                   "starting with a letter or digit (default: generated)")
    p.add_argument("--timeout-s", type=float)
    p.add_argument("--follow", action="store_true", help="wait for the end, showing progress")
    p.add_argument("--progress", choices=("auto", "live", "json", "plain"), default="auto")
    p.add_argument("--json", action="store_true", help="results as JSON lines")
