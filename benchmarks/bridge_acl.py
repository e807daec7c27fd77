"""The core broker's cost of region-scoped bridge accounts: CPU per bridged message and load
time, for a region on one bridge and split over bridges, beside the wildcard rules of old.

    python benchmarks/bridge_acl.py [--devices 25000] [--messages 20000] [--quick]

``fleetctl broker-config --core`` writes a tier whose region ``eu`` has ``--devices`` devices;
only the core runs. A client logged in with a bridge's account (as the region's bridge does)
publishes ``--messages`` telemetry messages (QoS 0) and as many results (QoS 1), each for a
random device that bridge carries, and an operator account receives them all. Figures: the
core's CPU time (from /proc) per message, and how long the core takes to start (it loads the
ACL). Three configurations of the core's ``acl-bridges``:

- ``wildcards``: ``dev/+/status`` and the like, what the core had before bridge accounts were
  scoped (a region could speak for any device);
- ``one bridge``: the region on one bridge, one rule per device (``--devices-per-bridge``
  as large as the region);
- ``split``: the default, a bridge per ``--per-bridge`` devices (1,000).

Target: a result through a split region costs the core <= 25 us of CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
import yaml  # noqa: E402

from benchmarks.harness import parse_args, verdict  # noqa: E402
from fleet.broker.bridge import DEVICES_PER_BRIDGE  # noqa: E402
from fleet.cli import main as fleetctl  # noqa: E402
from tests.support.mosquitto import free_port  # noqa: E402

TARGET_US = 25.0
WILDCARDS = [f"topic write fleet/v1/dev/+/{k}" for k in ("status", "res", "evt/#", "telemetry")]


def provision(work: Path, n: int, per_bridge: int) -> tuple[Path, dict, int, int]:
    """broker-config for one region of ``n`` devices (and one device in another): the core's
    folder, the summary, the bridge and operator ports."""
    devs = {f"d{i:06d}": {"region": "eu"} for i in range(n)} | {"u000001": {"region": "us"}}
    work.mkdir(parents=True, exist_ok=True)
    (work / "inventory.yaml").write_text(yaml.safe_dump({"devices": devs}))
    bridge, op = free_port(), free_port()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = fleetctl(["broker-config", "--inventory", str(work / "inventory.yaml"),
                       "--out", str(work / "tier"), "--secrets", str(work / "secrets"),
                       "--core", f"127.0.0.1:{bridge}", "--bridge-listener",
                       f"127.0.0.1:{bridge}", "--operator-listener", f"127.0.0.1:{op}",
                       "--devices-per-bridge", str(per_bridge)])
    assert rc == 0
    return work / "tier" / "core", json.loads(buf.getvalue()), bridge, op


def wildcard_acl(acl: str) -> str:
    """The same file with each bridge's per-device rules replaced by the wildcards of old."""
    out = []
    for line in acl.splitlines():
        if line.startswith("topic write fleet/v1/dev/"):
            continue
        out.append(line)
        if line.startswith("topic write $SYS"):
            out += WILDCARDS
    return "\n".join(out) + "\n"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_core(core: Path, op: int) -> tuple[subprocess.Popen[bytes], float]:
    """mosquitto on the core's conf (``user root`` when root, to read its 0600 files); the
    process and the seconds until its operator listener (the last one) took a connection."""
    conf = core / "bench.conf"
    conf.write_text((core / "mosquitto.conf").read_text()
                    + ("user root\n" if os.geteuid() == 0 else "") + "log_dest none\n")
    t0 = time.monotonic()
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stderr=subprocess.DEVNULL)
    while True:
        try:
            socket.create_connection(("127.0.0.1", op), timeout=0.2).close()
            return proc, time.monotonic() - t0
        except OSError:
            if proc.poll() is not None or time.monotonic() - t0 > 600:
                raise RuntimeError("the core broker did not start") from None
            time.sleep(0.02)


def client(port: int, user: str, password: str, client_id: str = "") -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                    protocol=mqtt.MQTTv5)
    c.username_pw_set(user, password)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def _count(got: list[int], done: threading.Event, messages: int) -> None:
    got[0] += 1
    if got[0] >= messages:
        done.set()


def measure(core: Path, summary: dict, bridge: int, op: int, messages: int
            ) -> dict[str, float]:
    """Core start seconds, and CPU us per telemetry message and per result."""
    secrets = core.parents[1] / "secrets"
    account = summary["regions"]["eu"]["bridges"][0]
    acl = (core / "acl-bridges").read_text()
    block = acl.split(f"user {account}\n")[1].split("\n\n")[0]
    carried = [r.split("/")[3] for r in block.splitlines()
               if r.startswith("topic write fleet") and "+" not in r]
    if not carried:  # wildcards: any of the region's devices
        carried = [f"d{i:06d}" for i in range(summary["regions"]["eu"]["devices"])]
    proc, start_s = start_core(core, op)
    row = {"start_s": round(start_s, 3)}
    try:
        watch_pw = (secrets / "operators" / "fleet-watch.password").read_text().strip()
        bridge_pw = (secrets / "bridges" / "bridge-eu.password").read_text().strip()
        rnd = random.Random(1)
        for kind, qos in (("telemetry", 0), ("res", 1)):
            got, done = [0], threading.Event()
            sub = client(op, "fleet-watch", watch_pw)
            sub.on_message = lambda c, ud, m, got=got, done=done: _count(got, done, messages)
            sub.subscribe(f"fleet/v1/dev/+/{kind}", 0)
            pub = client(bridge, account, bridge_pw, account)
            time.sleep(0.5)  # both connected and subscribed
            c0 = cpu_s(proc.pid)
            for _ in range(messages):
                pub.publish(f"fleet/v1/dev/{rnd.choice(carried)}/{kind}", b'{"x":1}', qos=qos)
            if not done.wait(600):
                raise RuntimeError(f"{kind}: {got[0]} of {messages} messages arrived")
            row[f"{kind}_us"] = round((cpu_s(proc.pid) - c0) / messages * 1e6, 1)
            for c in (pub, sub):
                c.disconnect()
                c.loop_stop()
    finally:
        proc.terminate()
        proc.wait(60)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=25000, help="devices of region eu")
    ap.add_argument("--messages", type=int, default=20000, help="of each kind")
    ap.add_argument("--per-bridge", type=int, default=DEVICES_PER_BRIDGE)
    a = parse_args(ap, quick={"devices": 2000, "messages": 1000, "per_bridge": 200})
    if shutil.which("mosquitto") is None:
        print("mosquitto is not installed (make services)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bridge-acl-"))
    rows = {}
    try:
        for name, per_bridge in (("wildcards", a.devices), ("one bridge", a.devices),
                                 ("split", a.per_bridge)):
            core, summary, bridge, op = provision(work / name.replace(" ", "-"), a.devices,
                                                  per_bridge)
            if name == "wildcards":
                acl = core / "acl-bridges"
                acl.write_text(wildcard_acl(acl.read_text()))
            rows[name] = measure(core, summary, bridge, op, a.messages)
            rows[name]["bridges"] = len(summary["regions"]["eu"]["bridges"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"region of {a.devices} devices, {a.messages} messages of each kind; the core's "
          "CPU per bridged message and its start (ACL load) time")
    print(f"{'config':<11} {'bridges':>7} {'start s':>8} {'telemetry us':>12} {'result us':>9}")
    for name, r in rows.items():
        print(f"{name:<11} {r['bridges']:>7} {r['start_s']:>8.2f} {r['telemetry_us']:>12.1f} "
              f"{r['res_us']:>9.1f}")
    print(json.dumps({"devices": a.devices, "messages": a.messages,
                      "per_bridge": a.per_bridge, "rows": rows}))
    split = rows["split"]
    verdict("core CPU per bridged result, region split over bridges", split["res_us"], "<=",
            TARGET_US, "us", also=[("split telemetry <= 25 us", split["telemetry_us"] <= 25)],
            note=f"one bridge {rows['one bridge']['res_us']:g} us, wildcards "
                 f"{rows['wildcards']['res_us']:g} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
