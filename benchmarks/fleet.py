"""Fleet rollout benchmark: a deploy rollout to 1,000 simulated devices on loopback.

One wave of 100%, no bake, through the real ``fleetctl rollout create`` (its own process, so
its CPU seconds and peak RSS are its own) against a real mosquitto, with the simulated
devices in a third process (one selector thread, one MQTT client per device). Printed:

- wall time of ``fleetctl rollout create`` (discovery + rollout + report), beside the 60 s
  target, and the rollout alone (first send to last result) from the report;
- broker messages and bytes per device, in and out, from mosquitto's ``$SYS`` counters,
  beside the contract's floor (command, ACCEPTED, IN_PROGRESS, SUCCEEDED, model_committed =
  5 PUBLISH in, plus the new retained status, which mosquitto 2.0's publish counter skips:
  retained PUBLISHes are not counted there; bytes include them);
- controller CPU seconds (user + system) and peak RSS.

    python benchmarks/fleet.py                # 1,000 devices
    python benchmarks/fleet.py --devices 200  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402

from tests.support.mosquitto import Broker, start_mosquitto  # noqa: E402

TARGET_WALL_S = 60.0
FLOOR_MSGS_IN = 5  # non-retained PUBLISH per device, see the docstring
SYS_TOPICS = {
    "$SYS/broker/publish/messages/received": "msgs_in",
    "$SYS/broker/publish/messages/sent": "msgs_out",
    "$SYS/broker/messages/received": "packets_in",
    "$SYS/broker/messages/sent": "packets_out",
    "$SYS/broker/bytes/received": "bytes_in",
    "$SYS/broker/bytes/sent": "bytes_out",
}


def broker_counters(broker: Broker) -> dict[str, int]:
    """mosquitto's cumulative counters (published every sys_interval, retained)."""
    got: dict[str, int] = {}
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-sys-{time.time_ns()}")
    c.on_message = lambda cl, ud, m: got.__setitem__(SYS_TOPICS[m.topic], int(m.payload))
    c.username_pw_set(broker.username, broker.password)
    c.connect("127.0.0.1", broker.port)
    c.subscribe([(t, 0) for t in SYS_TOPICS])
    c.loop_start()
    # Values are published each sys_interval when they changed, retained: after 2 quiet
    # intervals the last one we hold is current.
    time.sleep(2.2)
    deadline = time.monotonic() + 5
    while len(got) < len(SYS_TOPICS) and time.monotonic() < deadline:
        time.sleep(0.05)
    c.disconnect()
    c.loop_stop()
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--job-duration-s", type=float, default=0.05)
    a = ap.parse_args()
    if shutil.which("mosquitto") is None:
        print("mosquitto is not installed: apt-get install mosquitto", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    broker = start_mosquitto(work / "broker", extra_conf="sys_interval 1\nmax_connections -1")
    port = broker.port
    login = ["--username", str(broker.username), "--password-file", str(broker.password_file)]
    sim = subprocess.Popen(
        [sys.executable, "-m", "fleet.sim", "--port", str(port), *login,
         "--devices", str(a.devices), "--job-duration-s", str(a.job_duration_s)],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        t0 = time.perf_counter()
        assert sim.stdout is not None
        ready = json.loads(sim.stdout.readline())
        print(f"{ready['devices']} simulated devices online in {time.perf_counter() - t0:.1f} s")
        before = broker_counters(broker)
        argv = [sys.executable, "-m", "fleet.cli", "--port", str(port), *login, "--db",
                str(work / "fleet.db"), "--report-dir", str(work / "reports"), "-q",
                "rollout", "create", "--name", "bench", "--group", "sim", "--job", "deploy",
                "--args", '{"version": "v2"}', "--waves", "100%", "--bake-s", "0"]
        t0 = time.perf_counter()
        ctl = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, status, ru = os.wait4(ctl.pid, 0)
        wall = time.perf_counter() - t0
        out = ctl.stdout.read().decode() if ctl.stdout else ""
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0:
            print(out, ctl.stderr.read().decode() if ctl.stderr else "", file=sys.stderr)
            return 1
        after = broker_counters(broker)
        rep = json.loads((work / "reports" / "bench.json").read_text())
        jobs = [e for e in rep["executions"] if e["kind"] == "job"]
        ok = sum(e["status"] == "SUCCEEDED" for e in jobs)
        rollout_s = max(e["finished_at"] for e in jobs) - min(e["sent_at"] for e in jobs)
        n = a.devices
        d = {k: after[k] - before[k] for k in SYS_TOPICS.values()}
        # The counter samples also include the two $SYS readers' own traffic (a few msgs).
        print(f"rollout: {ok}/{n} SUCCEEDED, state {rep['state']}")
        print(f"fleetctl rollout create wall: {wall:.2f} s  (target <= {TARGET_WALL_S:.0f} s, "
              f"ratio {wall / TARGET_WALL_S:.2f})")
        print(f"  of which first send -> last result: {rollout_s:.2f} s")
        print(f"broker per device: {d['msgs_in'] / n:.2f} non-retained msgs in (floor "
              f"{FLOOR_MSGS_IN}, ratio {d['msgs_in'] / n / FLOOR_MSGS_IN:.2f}), "
              f"{d['msgs_out'] / n:.2f} msgs out (PUBLISH); all packets incl. PUBACK "
              f"{d['packets_in'] / n:.2f} in, {d['packets_out'] / n:.2f} out; "
              f"{d['bytes_in'] / n:.0f} B in, {d['bytes_out'] / n:.0f} B out")
        cpu = ru.ru_utime + ru.ru_stime
        print(f"controller: {cpu:.2f} CPU s ({ru.ru_utime:.2f} user + {ru.ru_stime:.2f} sys), "
              f"peak RSS {ru.ru_maxrss / 1024:.0f} MB")
        print(json.dumps({"devices": n, "wall_s": round(wall, 2), "rollout_s": round(rollout_s, 2),
                          "msgs_in_per_device": round(d["msgs_in"] / n, 2),
                          "msgs_out_per_device": round(d["msgs_out"] / n, 2),
                          "bytes_in_per_device": round(d["bytes_in"] / n),
                          "bytes_out_per_device": round(d["bytes_out"] / n),
                          "controller_cpu_s": round(cpu, 2),
                          "controller_peak_rss_mb": round(ru.ru_maxrss / 1024)}))
        return 0 if ok == n and wall <= TARGET_WALL_S else 1
    finally:
        sim.terminate()
        sim.wait(30)
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
