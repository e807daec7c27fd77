"""Simulated devices that speak the agent's MQTT contract, many per process.

Each device has its own MQTT client (own client id, persistent session, retained status with
``conn_seq`` and an offline last will), answers ACCEPTED/REJECTED at once, runs one job at a
time with IN_PROGRESS, ends each command with exactly one terminal result, answers a repeated
id with DUPLICATE, and reports JobOutcome results (metrics before/after) with
model_committed / model_rolled_back events. The job itself is simulated: a duration, an
outcome and an accuracy delta per device.

All clients of a process share ONE thread driving paho's external-loop API through a
selector (epoll), so 1,000 devices cost one thread, not 1,000.

    python -m fleet.sim --port 1883 --username sim --password-file sim.password \
        --devices 1000 --group sim --job-duration-s 0.5

Against brokers from ``fleetctl broker-config`` (one account per device, e.g. one process per
regional broker of a tier, each with its own id range)::

    python -m fleet.sim --port 1883 --password-dir SECRETS/devices \
        --devices 500 --first-index 0 --group line-3

This module is the command line; the devices are ``fleet.sim.device``, what they simulate is
``fleet.sim.config``, and the one thread that drives them all is ``fleet.sim.fleet``.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path
from typing import Any

from fleet.mqtt import BrokerConfig
from fleet.sim.config import SimConfig
from fleet.sim.fleet import SimFleet
from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections, wait_for_stop


@private_umask()
def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    ap = argparse.ArgumentParser(prog="python -m fleet.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--prefix", default=BrokerConfig().prefix)
    ap.add_argument("--username", help="broker account of every simulated device")
    ap.add_argument("--password-file", type=Path, help="file holding that account's password")
    ap.add_argument("--password-dir", type=Path,
                    help="per-device accounts instead (a broker from fleetctl broker-config): "
                         "device <id> logs in as <id> with DIR/<id>.password (SECRETS/devices)")
    ap.add_argument("--config", type=Path, help="SimConfig as JSON (flags below override)")
    ap.add_argument("--devices", type=int)
    ap.add_argument("--id-prefix")
    ap.add_argument("--first-index", type=int)
    ap.add_argument("--group", action="append", help="group of every device (repeatable)")
    ap.add_argument("--job-duration-s", type=float)
    ap.add_argument("--fail-share", type=float)
    ap.add_argument("--acc-delta", type=float)
    ap.add_argument("--defer", type=int, metavar="N",
                    help="answer DEFERRED to the first N deliveries of each job command")
    ap.add_argument("--defer-recheck-s", type=float, help="their recheck_after_s (1-3600)")
    ap.add_argument("--telemetry-s", type=float, help="telemetry period (default: none)")
    ap.add_argument("--summary", type=Path, help="write executed jobs per device here at exit")
    a = ap.parse_args(argv)
    if a.password_dir is not None and (a.username or a.password_file):
        ap.error("--password-dir gives each device its own account: drop --username and "
                 "--password-file")
    data: dict[str, Any] = json.loads(a.config.read_text()) if a.config else {}
    for key in ("devices", "id_prefix", "first_index", "fail_share", "telemetry_s"):
        if getattr(a, key) is not None:
            data[key] = getattr(a, key)
    if a.group:
        data["groups"] = a.group
    beh = data.setdefault("behavior", {})
    if a.job_duration_s is not None:
        beh["job_duration_s"] = a.job_duration_s
    if a.acc_delta is not None:
        beh["acc_delta"] = a.acc_delta
    for key in ("defer", "defer_recheck_s"):
        if getattr(a, key) is not None:
            beh[key] = getattr(a, key)
    cfg = SimConfig.model_validate(data)
    fleet = SimFleet(cfg, BrokerConfig(host=a.host, port=a.port, prefix=a.prefix,
                                       username=a.username, password_file=a.password_file),
                     password_dir=a.password_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet.start()
    print(json.dumps({"event": "sim_ready", "devices": len(fleet.devices)}), flush=True)
    wait_for_stop(stop)
    fleet.stop()
    if a.summary:
        a.summary.write_text(json.dumps(fleet.summary()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
