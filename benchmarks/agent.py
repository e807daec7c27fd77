"""edge-agent benchmark: ping latency beside a bare paho echo client, idle RSS/CPU, hardening.

    python benchmarks/agent.py [--pings 1000] [--idle-s 60] [--quick]

1. A real mosquitto on loopback, provisioned as an operator does it (``fleetctl broker-config``:
   an account per device on the device listener, the operator tools' accounts on their own),
   the real ``edge-agent`` process logged in with its device account, 1,000 pings one after
   the other from the ``fleet-send`` operator account (as ``fleetctl send``): command publish
   -> ACCEPTED result received (p50/p99). Beside it, in the same run, a bare paho client in
   its own process, logged in as a second device, that answers each request with one QoS 1
   publish (the floor: what the same two MQTT hops cost without validation, persistence or
   the outbox). Target: p99 <= 5 ms; the ratio to the echo floor is printed.
2. The daemon idle (telemetry every 10 s, no job) for ``--idle-s``: RSS (target <= 80 MB)
   and CPU share (target <= 0.5%), from /proc.
3. ``systemd-analyze security --offline=true systemd/edge-agent.service`` exposure (<= 2.5).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
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
from tests.support.mosquitto import Broker, free_port, start_from_conf  # noqa: E402

DEVICE, ECHO_DEVICE, OPERATOR = "bench-dev", "bench-echo", "fleet-send"
"""The daemon's device account, the echo's, and the operator tool account the pings use."""
ECHO_OPERATOR = "fleet-send-echo"
"""The echo's pings run beside the daemon's: an account of their own (one live connection
per account on a broker-config broker)."""
PREFIX = "fleet/v1"
ECHO = """
import sys, socket, paho.mqtt.client as mqtt
port, user, password_file, prefix = sys.argv[1:5]
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5)
c.username_pw_set(user, open(password_file).read().strip())
c.on_socket_open = lambda cl, ud, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.on_connect = lambda cl, ud, f, rc, p: cl.subscribe(f"{prefix}/dev/{user}/cmd/#", 1)
c.on_subscribe = lambda cl, ud, mid, codes, p: print("up", flush=True)
c.on_message = lambda cl, ud, m: cl.publish(f"{prefix}/dev/{user}/res", m.payload, qos=1)
c.connect("127.0.0.1", int(port))
c.loop_forever()
"""


def provision(work: Path, env: dict[str, str]) -> tuple[Broker, int, Path]:
    """``fleetctl broker-config`` for the two devices, mosquitto started on what it wrote:
    (the broker, its device listener's port, the secrets folder)."""
    inventory = work / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"devices": {DEVICE: {}, ECHO_DEVICE: {}}}))
    device_port, operator_port = free_port(), free_port()
    secrets = work / "secrets"
    out = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "broker-config", "--inventory", str(inventory),
         "--out", str(work / "broker-conf"), "--secrets", str(secrets),
         "--device-listener", f"127.0.0.1:{device_port}",
         "--operator-listener", f"127.0.0.1:{operator_port}",
         "--operator", f"{ECHO_OPERATOR}=fleet-send"],
        check=True, capture_output=True, text=True, env=env, cwd=REPO)
    conf = Path(yaml.safe_load(out.stdout)["conf"])
    # The operator listener comes second in the conf: once it answers, both do.
    return start_from_conf(conf, operator_port, work / "broker"), device_port, secrets


class Pinger:
    """An operator tool's connection (its own account on the operator listener)."""

    def __init__(self, port: int, user: str, password_file: Path, sub: str,
                 want: str | None = None) -> None:
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                             client_id=f"bench-{'-'.join(sub.split('/')[-2:])}-{os.getpid()}",
                             protocol=mqtt.MQTTv5)
        self.c.username_pw_set(user, password_file.read_text().strip())
        self.c.on_socket_open = lambda cl, ud, s: s.setsockopt(6, 1, 1)  # TCP_NODELAY
        self.got = threading.Event()
        self.want = want
        self.c.on_message = self._msg
        granted: list[list[mqtt.ReasonCode]] = []
        subscribed = threading.Event()
        self.c.on_subscribe = lambda cl, ud, mid, codes, props: (granted.append(codes),
                                                                 subscribed.set())
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.c.subscribe(sub, 1)
        if not subscribed.wait(10) or any(c.is_failure for c in granted[0]):
            raise RuntimeError(f"{user}: subscription to {sub} refused ({granted})")

    def _msg(self, cl: mqtt.Client, ud: object, m: mqtt.MQTTMessage) -> None:
        if self.want is not None and self.want.encode() in m.payload:
            self.got.set()

    def run(self, topic: str, payloads: list[tuple[str, bytes]]) -> list[float]:
        out = []
        for key, payload in payloads:
            self.want = key
            self.got.clear()
            t0 = time.perf_counter()
            self.c.publish(topic, payload, qos=1)
            if not self.got.wait(5):
                raise RuntimeError(f"no answer to {key}")
            out.append((time.perf_counter() - t0) * 1000)
        return out

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m[1]) / 1024 if m else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pings", type=int, default=1000)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="pause between the ping burst and the idle measurement")
    a = parse_args(ap, quick={"pings": 100, "idle_s": 2.0, "settle_s": 0.5})
    work = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    broker, device_port, secrets = provision(work, env)
    operator_pw = secrets / "operators" / f"{OPERATOR}.password"
    cfg = {"device_id": DEVICE, "state_dir": str(work / "state"), "socket_group": None,
           "telemetry_s": 10, "sensors": "auto",
           "mqtt": {"host": "127.0.0.1", "port": device_port, "username": DEVICE,
                    "password_file": str(secrets / "devices" / f"{DEVICE}.password")}}
    (work / "agent.yaml").write_text(yaml.safe_dump(cfg))
    with open(work / "daemon.log", "wb") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "agent.daemon", "--config",
                                   str(work / "agent.yaml"), "--log-format", "json"],
                                  stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=REPO)
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(device_port), ECHO_DEVICE,
                             str(secrets / "devices" / f"{ECHO_DEVICE}.password"), PREFIX],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "up"
        # The daemon is connected and subscribed once its retained online status is out.
        status = Pinger(broker.port, OPERATOR, operator_pw, f"{PREFIX}/dev/{DEVICE}/status",
                        want='"online"')
        if not status.got.wait(60):
            raise RuntimeError(f"{DEVICE} not online after 60 s: "
                               f"{(work / 'daemon.log').read_text()[-2000:]}")
        status.close()
        from datetime import datetime, timezone

        def ping(i: int) -> tuple[str, bytes]:
            cid = f"bench-{i}-{time.time_ns()}"
            return cid, json.dumps({"v": 1, "id": cid, "type": "ping",
                                    "issued_at": datetime.now(timezone.utc).isoformat()}).encode()

        agent_p = Pinger(broker.port, OPERATOR, operator_pw, f"{PREFIX}/dev/{DEVICE}/res")
        echo_p = Pinger(broker.port, ECHO_OPERATOR,
                        secrets / "operators" / f"{ECHO_OPERATOR}.password",
                        f"{PREFIX}/dev/{ECHO_DEVICE}/res")
        warm = [ping(-i - 1) for i in range(min(50, a.pings))]
        agent_p.run(f"{PREFIX}/dev/{DEVICE}/cmd/ping", warm)
        lat_agent: list[float] = []
        lat_echo: list[float] = []
        # Interleave in blocks so both see the same machine load.
        for block in range(0, a.pings, 100):
            n = min(100, a.pings - block)
            lat_agent += agent_p.run(f"{PREFIX}/dev/{DEVICE}/cmd/ping",
                                     [ping(block + i) for i in range(n)])
            lat_echo += echo_p.run(f"{PREFIX}/dev/{ECHO_DEVICE}/cmd/ping",
                                   [ping(block + i) for i in range(n)])
        agent_p.close()
        echo_p.close()
        a50, a99, e50, e99 = (pct(lat_agent, 0.5), pct(lat_agent, 0.99), pct(lat_echo, 0.5),
                              pct(lat_echo, 0.99))
        print(f"pings: {a.pings} sequential, command -> ACCEPTED (ms)")
        print(f"  edge-agent   p50 {a50:6.2f}  p99 {a99:6.2f}  "
              f"mean {statistics.mean(lat_agent):.2f}"
              f"   target p99 <= 5 ms: {'OK' if a99 <= 5 else 'MISSED'}")
        print(f"  paho echo    p50 {e50:6.2f}  p99 {e99:6.2f}  "
              f"mean {statistics.mean(lat_echo):.2f}")
        print(f"  ratio agent/echo  p50 {a50 / e50:.2f}x  p99 {a99 / e99:.2f}x")

        time.sleep(a.settle_s)  # let the ping burst settle before measuring idle
        cpu0, t0 = proc_cpu_s(daemon.pid), time.monotonic()
        rss_peak = 0.0
        while time.monotonic() - t0 < a.idle_s:
            rss_peak = max(rss_peak, proc_rss_mb(daemon.pid))
            time.sleep(1.0)
        cpu_pct = 100 * (proc_cpu_s(daemon.pid) - cpu0) / (time.monotonic() - t0)
        torch_loaded = "torch" in Path(f"/proc/{daemon.pid}/maps").read_text()
        print(f"idle {a.idle_s:.0f}s: RSS {rss_peak:.1f} MB (target <= 80: "
              f"{'OK' if rss_peak <= 80 else 'MISSED'}), CPU {cpu_pct:.2f}% (target <= 0.5: "
              f"{'OK' if cpu_pct <= 0.5 else 'MISSED'}), torch mapped: {torch_loaded}")
    finally:
        daemon.terminate()
        echo.terminate()
        daemon.wait(35)
        echo.wait(5)
        broker.stop()
    also = [("idle RSS <= 80 MB", rss_peak <= 80), ("idle CPU <= 0.5%", cpu_pct <= 0.5)]
    if shutil.which("systemd-analyze"):
        s = subprocess.run(["systemd-analyze", "security", "--offline=true",
                            str(REPO / "systemd" / "edge-agent.service")],
                           capture_output=True, text=True)
        m = re.search(r"exposure level for edge-agent.service: ([\d.]+)", s.stdout)
        level = float(m[1]) if m else float("nan")
        print(f"systemd-analyze security exposure: {level} (target <= 2.5: "
              f"{'OK' if level <= 2.5 else 'MISSED'})")
        also.append(("systemd exposure <= 2.5", level <= 2.5))
    shutil.rmtree(work, ignore_errors=True)
    verdict("edge-agent ping p99", a99, "<=", 5.0, "ms", also=also,
            note=f"ratio to the paho echo floor p99 {a99 / e99:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
