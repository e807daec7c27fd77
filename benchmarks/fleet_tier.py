"""What benchmarks/fleet.py stands on: the brokers (one mosquitto, or a bridged tier written by
``fleetctl broker-config --core``), the simulated device processes, mosquitto's ``$SYS``
counters, the fleetctl processes with their rusage, and the figures read back from a
rollout's db."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import yaml

from fleet.broker.config import load_inventory
from fleet.db import Database
from fleet.sim.config import SimConfig
from tests.support.mosquitto import Broker, free_port, start_mosquitto, write_password_file

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
REGIONS = ("eu", "us")
SYS_TOPICS = {
    "$SYS/broker/publish/messages/received": "msgs_in",
    "$SYS/broker/publish/messages/sent": "msgs_out",
    "$SYS/broker/messages/received": "packets_in",
    "$SYS/broker/messages/sent": "packets_out",
    "$SYS/broker/bytes/received": "bytes_in",
    "$SYS/broker/bytes/sent": "bytes_out",
}
STATS_USER = "bench-stats"
OPEN = ("SENT", "ACCEPTED", "IN_PROGRESS")


def _client(b: Broker, what: str) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-{what}-{time.time_ns()}")
    c.username_pw_set(b.username, b.password)
    c.connect(b.host, b.port)
    return c


def broker_counters(brokers: dict[str, Broker]) -> dict[str, dict[str, int]]:
    """Each broker's cumulative counters (published every sys_interval, retained), all read
    at once: after 2 quiet intervals the last value each holds is current."""
    got: dict[str, dict[str, int]] = {name: {} for name in brokers}
    clients = []
    for name, b in brokers.items():
        c = _client(b, "sys")
        c.on_message = lambda cl, ud, m, name=name: got[name].__setitem__(
            SYS_TOPICS[m.topic], int(m.payload))
        c.subscribe([(t, 0) for t in SYS_TOPICS])
        c.loop_start()
        clients.append(c)
    time.sleep(2.2)
    deadline = time.monotonic() + 5
    while any(len(g) < len(SYS_TOPICS) for g in got.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for c in clients:
        c.disconnect()
        c.loop_stop()
    return got


def wait_topics(b: Broker, topic: str, count: int, want: bytes, timeout_s: float) -> float:
    """Seconds until ``count`` distinct topics under ``topic`` carry a payload containing
    ``want`` (e.g. the devices' retained online statuses as the core sees them)."""
    seen: set[str] = set()
    t0 = time.monotonic()
    c = _client(b, "wait")
    c.on_message = lambda cl, ud, m: seen.add(m.topic) if want in m.payload else None
    c.subscribe(topic, 1)
    c.loop_start()
    try:
        while len(seen) < count:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{topic}: {len(seen)}/{count} seen in {timeout_s:.0f} s")
            time.sleep(0.05)
        return time.monotonic() - t0
    finally:
        c.disconnect()
        c.loop_stop()


# --- the brokers and the devices ------------------------------------------------------------


@dataclass
class Setup:
    """Where fleetctl connects, the brokers whose counters are read (``core`` first), where
    each simulated device process goes, and what setting it up cost."""

    brokers: dict[str, Broker]
    login: list[str]
    """fleetctl's broker options (and --inventory in a tier)."""
    sims: list[tuple[int, int, int, list[str]]]
    """(port, first index, devices, login options) per sim process."""
    inventory_parse_s: float | None = None
    broker_config_s: float | None = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    replica_logins: list[list[str]] = field(default_factory=list)
    """The options of each controller replica, where each needs an account of its own (a
    broker from broker-config binds client ids to accounts); empty: ``login`` for all."""

    def stop(self) -> None:
        for b in reversed(list(self.brokers.values())):
            b.stop(60)


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """(first index, count) of ``parts`` near-equal ranges of 0..n-1."""
    cuts = [n * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(parts) if cuts[i + 1] > cuts[i]]


def start_single(work: Path, n: int, sim_procs: int) -> Setup:
    """One mosquitto, one shared account (today's benchmark)."""
    b = start_mosquitto(work / "broker", extra_conf="sys_interval 1\nmax_connections -1")
    login = ["--username", str(b.username), "--password-file", str(b.password_file)]
    return Setup({"core": b}, ["--port", str(b.port), *login],
                 [(b.port, first, k, login) for first, k in split(n, sim_procs)])


def _with_stats(conf: Path, stats_port: int, passwd: Path, pw: str, work: Path) -> Broker:
    """mosquitto on a conf broker-config wrote, plus what the benchmark needs: root may read
    its 0600 files, $SYS every second, and a listener of its own (127.0.0.1, one account, no
    ACL: per_listener_settings) to read $SYS and the statuses the core holds."""
    lines = [conf.read_text(), "user root" if os.geteuid() == 0 else "", "sys_interval 1",
             "log_type error", "log_type warning", "log_type notice", "log_dest stderr", "",
             f"listener {stats_port} 127.0.0.1", "allow_anonymous false",
             f"password_file {passwd}"]
    name = conf.parent.name
    bench_conf = work / f"{name}-bench.conf"
    bench_conf.write_text("\n".join(lines) + "\n")
    b = Broker("127.0.0.1", stats_port, bench_conf, work, log=work / f"{name}.log",
               username=STATS_USER, password=pw)
    return b.start(30)


def start_tier(work: Path, n: int, sim_procs: int, secrets_dir: Path) -> Setup:
    """``fleetctl broker-config --core`` for ``n`` devices (halves in eu and us, one account
    each), the core and both regions started on what it wrote, bridges connected."""
    work.mkdir(parents=True, exist_ok=True)
    ranges = {r: split(n, len(REGIONS))[i] for i, r in enumerate(REGIONS)}
    per_proc = {r: [(f + a, k) for a, k in split(c, sim_procs)] for r, (f, c) in ranges.items()}
    devices: dict[str, dict[str, Any]] = {}
    for r, procs in per_proc.items():
        for first, k in procs:  # the ids each sim process will use
            for d in SimConfig(devices=k, first_index=first).device_ids():
                devices[d] = {"groups": ["sim"], "region": r}
    inv = work / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"devices": devices}))
    t0 = time.perf_counter()
    load_inventory(inv)  # what every fleetctl given --inventory pays
    parse_s = time.perf_counter() - t0
    ports = {r: free_port() for r in REGIONS}
    bridge, op = free_port(), free_port()
    argv = [sys.executable, "-m", "fleet.cli", "broker-config", "--inventory", str(inv),
            "--out", str(work / "tier"), "--secrets", str(secrets_dir),
            "--core", f"127.0.0.1:{bridge}", "--bridge-listener", f"127.0.0.1:{bridge}",
            "--operator-listener", f"127.0.0.1:{op}",
            *[x for r, p in ports.items() for x in ("--region", f"{r}=127.0.0.1:{p}")],
            *[x for i in (1, 2) for x in ("--operator", f"replica-{i}=fleet-controller")]]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=ENV, timeout=600)
    config_s = time.perf_counter() - t0
    pw = secrets.token_hex(12)
    passwd = write_password_file(work / "stats.passwd", {STATS_USER: pw})
    brokers = {name: _with_stats(work / "tier" / name / "mosquitto.conf", free_port(), passwd,
                                 pw, work) for name in ("core", *REGIONS)}
    setup = Setup(brokers, [], [], parse_s, config_s)
    try:
        for r in REGIONS:
            wait_topics(brokers["core"], f"$SYS/broker/connection/bridge-{r}/state", 1, b"1",
                        30)
    except BaseException:
        setup.stop()
        raise
    def login(account: str) -> list[str]:
        return ["--port", str(op), "--username", account, "--password-file",
                str(secrets_dir / "operators" / f"{account}.password"), "--inventory", str(inv)]

    setup.login = login("fleet-controller")
    setup.replica_logins = [login("replica-1"), login("replica-2")]
    pdir = ["--password-dir", str(secrets_dir / "devices")]
    setup.sims = [(ports[r], first, k, pdir) for r, procs in per_proc.items()
                  for first, k in procs]
    return setup


def start_sims(setup: Setup, work: Path, job_duration_s: float) -> float:
    """Every sim process, each until its one JSON line says its devices are connected;
    seconds until the last one is."""
    t0 = time.perf_counter()
    for i, (port, first, k, login) in enumerate(setup.sims):
        setup.procs.append(subprocess.Popen(
            [sys.executable, "-m", "fleet.sim", "--port", str(port), *login,
             "--devices", str(k), "--first-index", str(first), "--group", "sim",
             "--job-duration-s", str(job_duration_s), "--summary", str(work / f"sim{i}.json")],
            stdout=subprocess.PIPE, stderr=open(work / f"sim{i}.log", "w"),  # noqa: SIM115
            text=True, env=ENV))
    for i, p in enumerate(setup.procs):
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"sim {i} exited: {(work / f'sim{i}.log').read_text()[-2000:]}")
        json.loads(line)
    return time.perf_counter() - t0


def stop_sims(setup: Setup, work: Path) -> list[dict[str, Any]]:
    """SIGTERM each sim process; their summaries (executed job ids per device, DUPLICATE
    answers)."""
    for p in setup.procs:
        p.send_signal(signal.SIGTERM)
    out = []
    for i, p in enumerate(setup.procs):
        p.wait(60)
        f = work / f"sim{i}.json"
        out.append(json.loads(f.read_text()) if f.exists() else {"missing": str(f)})
    setup.procs.clear()
    return out


# --- fleetctl processes -----------------------------------------------------------------------


@dataclass
class Proc:
    """A fleetctl process, its output in files, and (once reaped) its rusage."""

    name: str
    popen: subprocess.Popen[bytes]
    out: Path
    rc: int | None = None
    user_s: float = 0.0
    sys_s: float = 0.0
    rss_mb: float = 0.0
    ended: float = 0.0
    """time.time() when it was reaped."""

    @classmethod
    def spawn(cls, name: str, argv: list[str], logdir: Path) -> Proc:
        out = logdir / f"{name}.out"
        with open(out, "wb") as fo, open(logdir / f"{name}.err", "wb") as fe:
            p = subprocess.Popen(argv, stdout=fo, stderr=fe, env=ENV)
        return cls(name, p, out)

    def reap(self, block: bool) -> bool:
        """True once it has exited (its rusage taken)."""
        if self.rc is not None:
            return True
        pid, status, ru = os.wait4(self.popen.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        self.ended = time.time()
        self.rc = os.waitstatus_to_exitcode(status)
        self.popen.returncode = self.rc
        self.user_s, self.sys_s = ru.ru_utime, ru.ru_stime
        self.rss_mb = ru.ru_maxrss / 1024
        return True

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    def first_json(self) -> dict[str, Any]:
        return dict(json.loads(self.out.read_text().splitlines()[0]))

    def tail(self) -> str:
        err = self.out.with_suffix(".err")
        return (self.out.read_text() + err.read_text())[-3000:]


def rollout_facts(db: str, rid: str) -> dict[str, Any]:
    """From the controller's db: state, times, per-wave durations, and every job execution's
    status and attempt."""
    d = Database(db)
    try:
        state, created, finished, nonce = d.execute(
            "SELECT state, created_at, finished_at, nonce FROM rollouts WHERE id = :r",
            {"r": rid}).one()
        waves = d.execute("SELECT target, started_at, finished_at FROM waves "
                          "WHERE rollout_id = :r ORDER BY idx", {"r": rid}).fetchall()
        jobs = d.execute("SELECT device, attempt, status, sent_at, finished_at FROM executions "
                         "WHERE rollout_id = :r AND kind = 'job'", {"r": rid}).fetchall()
    finally:
        d.close()
    sent = [j[3] for j in jobs if j[3] is not None]
    done = [j[4] for j in jobs if j[4] is not None]
    return {
        "state": state, "key": f"{rid}-{nonce}", "created_at": created, "finished_at": finished,
        "first_sent": min(sent) if sent else None, "last_result": max(done) if done else None,
        "wave_sizes": [int(w[0]) for w in waves],
        "wave_s": [round(w[2] - w[1], 2) if w[1] and w[2] else None for w in waves],
        "succeeded_devices": len({j[0] for j in jobs if j[2] == "SUCCEEDED"}),
        "not_succeeded": sum(j[2] != "SUCCEEDED" for j in jobs),
        "max_attempt": max((int(j[1]) for j in jobs), default=0),
    }


class LeaseWatch:
    """The replicas' lease on one rollout and its last wave's progress, read from the db."""

    def __init__(self, db: str, rid: str) -> None:
        self.d = Database(db)
        self.rid = rid
        self.last_wave = int(self.d.execute(
            "SELECT MAX(idx) FROM waves WHERE rollout_id = :r", {"r": rid}).scalar())

    def owner(self) -> str | None:
        row = self.d.execute("SELECT owner, expires_at FROM leases WHERE rollout_id = :r",
                             {"r": self.rid}).fetchone()
        return None if row is None or row[1] < time.time() else str(row[0])

    def last_wave_progress(self) -> tuple[int, int, int]:
        """(sent, open, finished) job executions of the last wave."""
        row = self.d.execute(
            "SELECT COUNT(sent_at), SUM(CASE WHEN status IN ('SENT', 'ACCEPTED', "
            "'IN_PROGRESS') THEN 1 ELSE 0 END), COUNT(finished_at) FROM executions "
            "WHERE rollout_id = :r AND kind = 'job' AND wave = :w",
            {"r": self.rid, "w": self.last_wave}).one()
        return int(row[0] or 0), int(row[1] or 0), int(row[2] or 0)

    def close(self) -> None:
        self.d.close()


def executions_of(summaries: list[dict[str, Any]], key: str) -> dict[str, list[str]]:
    """Device -> the job ids of rollout ``key`` it ran (each should be exactly one)."""
    out: dict[str, list[str]] = {}
    for s in summaries:
        for dev, ids in (s.get("executed") or {}).items():
            mine = [i for i in ids if i.startswith(key + ".")]
            if mine:
                out[dev] = mine
    return out
