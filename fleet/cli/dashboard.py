"""``fleetctl dashboard``: serve the operator's live web page over the state db and the
broker (``fleet.dashboard``) until SIGTERM or Ctrl-C (``register`` adds its sub-parser).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path

from fleet.cli.options import EXIT_OK, UsageError, broker_config, inventory_membership
from registry.lifetime import wait_for_stop


def cmd_dashboard(a: argparse.Namespace) -> int:
    from fleet.dashboard.auth import TokenFileError, read_token  # starlette, jinja2, sse
    from fleet.dashboard.server import DashboardServer, Options
    from registry.credentials import is_loopback

    if not is_loopback(a.listen_host) and not a.allow_remote:
        raise UsageError(f"--host {a.listen_host} is not loopback: the page shows every "
                         "device and rollout; add --allow-remote on a network you trust "
                         "(and put TLS in front: the session cookie travels in clear)")
    if a.listen_host in ("0.0.0.0", "::") and not a.origin:
        raise UsageError(f"--host {a.listen_host}: give --origin http://NAME:PORT, the "
                         "address browsers reach the page at (writes from any other are "
                         "refused)")
    if not 0 <= a.nice <= 19:
        raise UsageError(f"--nice {a.nice}: 0 (the shell's priority) to 19 (the lowest)")
    if a.nice:
        # An observer on the controller's host: when the cores are busy (a 10,000-device
        # rollout), the controller and the broker go first and the page waits a little.
        os.nice(a.nice)
    token = None
    if a.operator_token_file is not None:
        try:
            token = read_token(a.operator_token_file)
        except TokenFileError as e:
            raise UsageError(str(e)) from None
    opts = Options(db=a.db, host=a.listen_host, port=a.listen_port, token=token,
                   extra_origins=tuple(a.origin or ()), max_live=a.max_live)
    try:
        server = DashboardServer(opts, broker_config(a), inventory_membership(a))
    except OSError as e:
        raise UsageError(f"--port {a.listen_port}: {e}") from None
    try:
        server.start(a.connect_timeout_s)
    except BaseException:
        server.close()
        raise
    print(json.dumps({"dashboard": server.url, "writable": token is not None}), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        wait_for_stop(stop)
    finally:
        server.close()
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    h = ("serve the operator's live web page: devices (online, group, model, job, "
         "temperature; those needing attention first), each rollout's waves and failures, "
         "fleet-learning rounds with their accuracy; read-only unless "
         "--operator-token-file (then approve, pause, resume and abort after a login)")
    p = sub.add_parser("dashboard", help=h, description=h)
    p.add_argument("--host", dest="listen_host", default="127.0.0.1", metavar="HOST",
                   help="address to serve on, after the command (the global --host before "
                        "it is the broker's); loopback unless --allow-remote")
    p.add_argument("--port", dest="listen_port", type=int, default=8780,
                   metavar="PORT", help="port (0: a free one, printed)")
    p.add_argument("--allow-remote", action="store_true",
                   help="let --host be a non-loopback address")
    p.add_argument("--origin", action="append", metavar="URL",
                   help="another origin the page is reached at, e.g. http://fleet.lan:8780 "
                        "(repeatable; required with --host 0.0.0.0)")
    p.add_argument("--operator-token-file", type=Path, metavar="FILE",
                   help="the operator token (one word, 16+ characters, file mode 0600): "
                        "without it the page is read-only and every write is refused 403")
    p.add_argument("--max-live", type=int, default=32, metavar="N",
                   help="live pages (server-sent event streams) at once; one more gets 503")
    p.add_argument("--nice", type=int, default=10, metavar="N",
                   help="lower this process's CPU priority by N (0-19; default 10): on the "
                        "controller's host the controller and the broker go first")
    p.set_defaults(fn=cmd_dashboard)
