"""agentctl serve's HTTP server: the Open Inference Protocol on uvicorn (``agent.runtime.oip``
on ``registry.http_server``) against the threaded ``http.server`` one it replaced
(benchmarks/oip_threaded.py), each in a process of its own, serving the same model from the
same state dir (the runtime tests' tiny linear model, [N, 1, 8, 8] -> 10 logits, ONNX Runtime
on 1 thread). One function per section (``--sections``).

    python benchmarks/http_server.py [--sections latency,connections,attack] [--json PATH]
    python benchmarks/http_server.py --quick    # every section, tiny: its figures mean nothing

latency: ``--clients`` kept-alive clients (threads of this process) send JSON infer requests
(batch 1) back to back for ``--latency-s`` seconds per round, the servers alternating over
``--rounds`` rounds: p50/p99 of a request and requests/s. Target: the new server's p50 within
1.25x the old one's.

connections: ``--idle-connections`` clients connect and send the first byte of a request
head, then nothing, both servers allowed that many; once the server has accepted them (its
open files stop growing): how many it holds,
its threads and its resident memory (VmRSS) before and with them. Target: less memory per
connection on the new server (its base is larger: uvicorn, Starlette and anyio imported).

attack: ``--drippers`` clients send a request head one byte a second (each read prompt, the
head never ending), reconnecting a second after they are cut or refused, while a normal client
sends an infer request every 0.5 s for ``--attack-s`` seconds, retrying a 503 or a refused
connection until it is served (``--give-up-s`` at most). Each server at its defaults (old: 32
connections, 10 s per read; new: 512 connections, the whole head within 10 s of accept), and
the old one also at the new one's 512 connections (a thread each). The normal client's request
time, p50 and max. Target (the headline): max <= 1 s on the new server.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing as mp
import os
import resource
import select
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # first: benchmarks/agent.py would shadow the package

from benchmarks.harness import meets, parse_args, verdict  # noqa: E402
from exporters.cpu_isa import detect_isa  # noqa: E402

MODEL = "digits"
INFER = f"/v2/models/{MODEL}/infer"
BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                               "data": [0.5] * 64}]}).encode()
DRIP_HEAD = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 8192
DEFAULTS = {"old": 32, "new": 512}
"""Each server's default connection limit (agentctl serve --max-connections)."""


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))] if s else float("nan")


def _more_files() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the servers, each in a child process ---------------------------------------------------------


def _serve(kind: str, state: str, max_connections: int, port_q: Any, stop: Any) -> None:
    """Child process: ``kind`` ("old" or "new") serving the model until ``stop`` is set."""
    _more_files()
    from agent.runtime.active_model import ActiveModel

    with ActiveModel(Path(state), MODEL, threads=1) as model:
        if kind == "new":
            from agent.runtime.oip import OipLimits, OipServer

            with OipServer(model, port=0, limits=OipLimits(
                    max_connections=max_connections)).start() as server:
                port_q.put(server.port)
                stop.wait()
        else:
            from benchmarks.oip_threaded import ThreadedOipServer

            old = ThreadedOipServer(model, max_connections=max_connections)
            threading.Thread(target=old.serve_forever, daemon=True).start()
            port_q.put(old.server_address[1])
            stop.wait()
            old.shutdown()
            old.server_close()


@contextlib.contextmanager
def served(kind: str, state: Path, max_connections: int) -> Iterator[tuple[int, int]]:
    """(port, pid) of ``kind`` serving from ``state``."""
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_serve, args=(kind, str(state), max_connections, port_q, stop))
    p.start()
    try:
        port = port_q.get(timeout=60)
        _wait_ready(port)
        yield port, p.pid or 0
    finally:
        stop.set()
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()


def _wait_ready(port: int) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        with contextlib.suppress(OSError, http.client.HTTPException):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/v2/health/ready")
            if c.getresponse().status == 200:
                c.close()
                return
        time.sleep(0.05)
    raise SystemExit(f"the server on port {port} never became ready")


def proc_status(pid: int) -> dict[str, float]:
    """The child's resident memory now and at peak (MiB) and its threads."""
    out: dict[str, float] = {"threads": float(len(os.listdir(f"/proc/{pid}/task")))}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def make_state(root: Path) -> Path:
    """A state dir with version 1 of the tiny model committed, as the runtime tests make it."""
    from registry.signing import generate_keypair, load_signing_key
    from tests.agent.runtime.conftest import Device

    keys = root / "keys"
    _, pub = generate_keypair(keys, "bench")
    (keys / "trusted").mkdir()
    (keys / "trusted" / pub.name).write_bytes(pub.read_bytes())
    (root / "state").mkdir()
    Device(root / "state", root / "work", load_signing_key(keys / "bench.key.pem"),
           keys / "trusted").install(1)
    return root / "state"


def infer_once(conn: http.client.HTTPConnection) -> int:
    conn.request("POST", INFER, BODY, {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status


# -- section: latency ------------------------------------------------------------------------------


def _load(port: int, clients: int, seconds: float) -> tuple[list[float], int]:
    """Request times (ms) of ``clients`` back-to-back kept-alive clients, and failures."""
    times: list[list[float]] = [[] for _ in range(clients)]
    failed = [0] * clients
    end = time.monotonic() + seconds

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                ok = infer_once(conn) == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
            if ok:
                times[i].append((time.perf_counter() - t0) * 1e3)
            else:
                failed[i] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for ts in times for x in ts], sum(failed)


def section_latency(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[float]] = {"old": [], "new": []}
    failed = {"old": 0, "new": 0}
    seconds = {"old": 0.0, "new": 0.0}
    with served("old", state, DEFAULTS["old"]) as (old_port, _), \
            served("new", state, DEFAULTS["new"]) as (new_port, _):
        ports = {"old": old_port, "new": new_port}
        for kind in ports:  # warm both
            _load(ports[kind], args.clients, min(1.0, args.latency_s))
        for r in range(args.rounds):  # interleaved, the order alternating
            for kind in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times, bad = _load(ports[kind], args.clients, args.latency_s)
                runs[kind] += times
                failed[kind] += bad
                seconds[kind] += args.latency_s
    res = {k: {"p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99), "n": len(v),
               "per_s": len(v) / seconds[k], "failed": failed[k]} for k, v in runs.items()}
    print(f"\n== latency: {args.clients} kept-alive clients, JSON infer batch 1, back to back, "
          f"{args.rounds} x {args.latency_s:g} s per server ==")
    print(f"{'server':<28} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'n':>7} {'failed':>6}")
    for k, label in (("old", "old: http.server threads"), ("new", "new: uvicorn (h11)")):
        r = res[k]
        print(f"{label:<28} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['per_s']:>8.0f} "
              f"{r['n']:>7} {r['failed']:>6}")
    res["p50_ratio"] = res["new"]["p50_ms"] / res["old"]["p50_ms"]
    res["p99_ratio"] = res["new"]["p99_ms"] / res["old"]["p99_ms"]
    print(f"new / old: p50 {res['p50_ratio']:.2f}x (target <= 1.25x), "
          f"p99 {res['p99_ratio']:.2f}x")
    return res


# -- section: idle connections ---------------------------------------------------------------------


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _accepted(pid: int, before: int, n: int, wait_s: float = 9.0) -> int:
    """Connections the server has accepted (its open files over ``before``), once all ``n``
    are in or the count stood still for 3 s."""
    end, last, since = time.monotonic() + wait_s, -1, time.monotonic()
    while time.monotonic() < end:
        now = _fds(pid) - before
        if now >= n:
            return now
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 3.0:
            break
        time.sleep(0.1)
    return max(last, 0)


def section_connections(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    n = args.idle_connections
    res: dict[str, Any] = {}
    for kind in ("old", "new"):
        with served(kind, state, n + 64) as (port, pid):
            time.sleep(0.5)
            before, fds = proc_status(pid), _fds(pid)
            socks = [socket.create_connection(("127.0.0.1", port), timeout=10)
                     for _ in range(n)]
            for s in socks:  # one byte of a head: a connection the server must wait on
                s.sendall(b"G")
            held = _accepted(pid, fds, n)
            during = proc_status(pid)
            for s in socks:
                s.close()
        res[kind] = {"held": held, "rss_before_mib": before["VmRSS"],
                     "rss_with_mib": during["VmRSS"], "threads_before": before["threads"],
                     "threads_with": during["threads"]}
        res[kind]["kib_per_connection"] = (
            1024 * (during["VmRSS"] - before["VmRSS"]) / held if held else float("nan"))
    print(f"\n== idle connections: {n} clients connect and send one byte (limit {n + 64}) ==")
    print(f"{'server':<28} {'held':>6} {'threads':>12} {'RSS MiB':>16} {'KiB/conn':>9}")
    for k, label in (("old", "old: http.server threads"), ("new", "new: uvicorn (h11)")):
        r = res[k]
        print(f"{label:<28} {r['held']:>6} {r['threads_before']:>5.0f} -> {r['threads_with']:<4.0f}"
              f" {r['rss_before_mib']:>6.1f} -> {r['rss_with_mib']:<6.1f} "
              f"{r['kib_per_connection']:>9.1f}")
    res["kib_ratio"] = res["new"]["kib_per_connection"] / res["old"]["kib_per_connection"]
    print(f"new / old memory per idle connection: {res['kib_ratio']:.2f}x (target <= 1x)")
    return res


# -- section: header drippers ---------------------------------------------------------------------


class Drippers:
    """``n`` clients sending ``DRIP_HEAD`` one byte a second, each reconnecting a second after
    the server closes or refuses it (connects never block the pace); counts cuts and
    refusals."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.socks: dict[socket.socket, int] = {}
        self.cuts = self.refusals = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Drippers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self.socks) < self.n:
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", self.port))
                self.socks[s] = 0
            for s, sent in list(self.socks.items()):
                try:
                    if s.send(DRIP_HEAD[sent % len(DRIP_HEAD):][:1]):
                        self.socks[s] = sent + 1
                except BlockingIOError:
                    pass  # still connecting: it starts next second
                except OSError:
                    self._drop(s)
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not self._stop.is_set():
                for s in select.select(list(self.socks), [], [], 0.05)[0]:
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data.startswith(b"HTTP/1.1 503"):
                        self.refusals += 1
                        self._drop(s, cut=False)
                    elif not data:
                        self._drop(s)

    def _drop(self, s: socket.socket, cut: bool = True) -> None:
        if self.socks.pop(s, None) is not None:
            self.cuts += cut
            s.close()


def _normal_request(port: int, give_up_s: float) -> float:
    """Seconds until one infer request was answered 200 (retrying refusals), or inf."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < give_up_s:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(0.5, give_up_s / 4))
        try:
            if infer_once(conn) == 200:
                return time.monotonic() - t0
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        time.sleep(0.1)
    return float("inf")


def section_attack(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    configs = [("old", DEFAULTS["old"], "old, defaults (32 threads)"),
               ("old", DEFAULTS["new"], "old at 512 connections (a thread each)"),
               ("new", DEFAULTS["new"], "new, defaults (512 connections)")]
    res: dict[str, Any] = {}
    for kind, limit, label in configs:
        with served(kind, state, limit) as (port, pid), Drippers(port, args.drippers) as d:
            time.sleep(min(2.0, args.attack_s / 4))  # the drippers connect and start
            times: list[float] = []
            end = time.monotonic() + args.attack_s
            while time.monotonic() < end:
                t0 = time.monotonic()
                times.append(_normal_request(port, args.give_up_s))
                time.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))
            status = proc_status(pid)
            held = len(d.socks)
        served_t = [t for t in times if t != float("inf")]
        res[f"{kind}-{limit}"] = {
            "label": label, "requests": len(times), "unserved": len(times) - len(served_t),
            "p50_s": pct(times, 0.5), "max_s": max(times) if times else float("nan"),
            "dripper_cuts": d.cuts, "dripper_refusals": d.refusals, "drippers_held": held,
            "threads": status["threads"], "rss_mib": status["VmRSS"]}
    print(f"\n== attack: {args.drippers} clients drip a request head at 1 byte/s for "
          f"{args.attack_s:g} s; a normal client's infer request every 0.5 s (retried until "
          f"served, {args.give_up_s:g} s at most) ==")
    print(f"{'server':<42} {'p50 s':>7} {'max s':>7} {'unserved':>9} {'cuts':>6} "
          f"{'503s':>6} {'threads':>8} {'RSS MiB':>8}")
    for r in res.values():
        print(f"{r['label']:<42} {r['p50_s']:>7.3f} {r['max_s']:>7.3f} "
              f"{r['unserved']:>4}/{r['requests']:<4} {r['dripper_cuts']:>6} "
              f"{r['dripper_refusals']:>6} {r['threads']:>8.0f} {r['rss_mib']:>8.1f}")
    return res


SECTIONS: dict[str, Callable[[Path, argparse.Namespace], dict[str, Any]]] = {
    "latency": section_latency,
    "connections": section_connections,
    "attack": section_attack,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of: {', '.join(SECTIONS)}")
    ap.add_argument("--clients", type=int, default=4, help="latency: concurrent clients")
    ap.add_argument("--latency-s", type=float, default=5.0, help="latency: seconds per round")
    ap.add_argument("--rounds", type=int, default=4, help="latency: rounds per server")
    ap.add_argument("--idle-connections", type=int, default=500,
                    help="connections: idle clients held")
    ap.add_argument("--drippers", type=int, default=200, help="attack: dripping clients")
    ap.add_argument("--attack-s", type=float, default=25.0,
                    help="attack: seconds of normal requests per server")
    ap.add_argument("--give-up-s", type=float, default=15.0,
                    help="attack: a normal request unanswered this long counts as unserved")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = parse_args(ap, {"latency_s": 0.5, "rounds": 1, "idle_connections": 20,
                           "drippers": 20, "attack_s": 2.0, "give_up_s": 2.0})
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    _more_files()
    isa = detect_isa()
    host = (f"host: {isa.model or 'unknown CPU'}, {os.cpu_count()} cores; "
            f"Python {sys.version.split()[0]}")
    print(host)
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        state = make_state(Path(tmp))
        results = {name: SECTIONS[name](state, args) for name in wanted}
    if args.json:
        args.json.write_text(json.dumps({"host": host, **results}, indent=2, default=str))
    print_verdict(results)
    return 0


def print_verdict(results: dict[str, dict[str, Any]]) -> None:
    """attack's headline target (else latency's, else connections'); the others counted."""
    heads: list[tuple[str, float, str, float, str]] = []
    if "attack" in results:
        heads.append(("normal client's slowest request under header drippers, new server",
                      results["attack"]["new-512"]["max_s"], "<=", 1.0, "s"))
    if "latency" in results:
        heads.append(("new / old server p50 latency", results["latency"]["p50_ratio"], "<=",
                      1.25, "x"))
    if "connections" in results:
        c = results["connections"]
        heads.append(("new / old server memory per idle connection", c["kib_ratio"], "<=", 1.0,
                      "x"))
    (what, value, op, target, unit), rest = heads[0], heads[1:]
    verdict(what, value, op, target, unit,
            also=[(name, meets(v, o, t)) for name, v, o, t, _ in rest])


if __name__ == "__main__":
    sys.exit(main())
