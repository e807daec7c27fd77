"""A real loopback HTTP registry server for tests and benchmarks.

``RegistryServer`` is a small HTTP/1.1 server (standard library, one thread per connection)
over a registry folder, as nginx or a CDN would serve it: GET and HEAD with single byte ranges
(206 / 416), keep-alive, PUT for uploads (atomic rename). It counts the body bytes it sends
and receives and can inject faults: cut connections at given byte offsets (FIN or RST), answer
errors, stall past the client's read timeout, refuse PUTs after a budget, drip bytes slowly
(slow retrieval), answer resumes for the wrong range, close after every response.

Run standalone (the benchmark does, so server and client do not share a GIL)::

    python tests/support/registry_server.py --root DIR   # prints the port, serves forever

and read ``GET /__stats__`` (JSON counters) / ``POST /__reset__`` / ``POST /__cut__?at=N``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_BLOCK = 256 << 10


@dataclass
class Served:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


@dataclass
class _Faults:
    cuts: list[int] = field(default_factory=list)
    """Absolute values of the bytes_served counter at which to cut the connection."""
    cut_mode: str = "fin"
    fail: list[tuple[int, str | None, str]] = field(default_factory=list)
    """(status, method or None, path substring) answered once each, in order."""
    stall: list[float] = field(default_factory=list)
    put_budget: int | None = None


class RegistryServer:
    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.root = Path(root).resolve()
        self.lock = threading.Lock()
        self.bytes_served = 0
        self.bytes_received = 0
        self.requests: list[Served] = []
        self.faults = _Faults()
        self.honour_range = True
        """False: answer 200 with the whole file to ranged GETs, as some proxies do."""
        self.moved_prefix: str | None = None
        """Paths under this prefix get a 301 to the same path without it (a moved registry)."""
        self.drip_bytes_per_s: float | None = None
        """Send every response (headers and body) at this rate: slow retrieval."""
        self.resume_from_zero = False
        """Answer a Range from a non-zero start with 'bytes 0-END/SIZE' and the bytes from 0."""
        self.resume_wrong_bytes = False
        """Answer a Range from a non-zero start with the right Content-Range, wrong bytes."""
        self.close_each_response = False
        """'Connection: close' on every answer: the client must reconnect for each request."""
        self._stop = threading.Event()
        handler = type("Handler", (_Handler,), {"owner": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread: threading.Thread | None = None

    # -- lifecycle

    def start(self) -> RegistryServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> RegistryServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- fault plan and counters

    def cut_at(self, offsets: list[int], mode: str = "fin") -> None:
        """Cut the connection once the server has sent each offset's worth of body bytes
        (offsets count from now)."""
        with self.lock:
            self.faults.cuts = sorted(self.bytes_served + o for o in offsets)
            self.faults.cut_mode = mode

    def fail_next(
        self, n: int, status: int = 503, method: str | None = None, path: str = ""
    ) -> None:
        with self.lock:
            self.faults.fail += [(status, method, path)] * n

    def stall_next(self, n: int, seconds: float) -> None:
        with self.lock:
            self.faults.stall += [seconds] * n

    def allow_puts(self, n: int | None) -> None:
        """Accept n more PUTs, then answer 503 until reset (None = unlimited)."""
        with self.lock:
            self.faults.put_budget = n

    def reset(self) -> None:
        with self.lock:
            self.bytes_served = self.bytes_received = 0
            self.requests = []
            self.faults = _Faults()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"bytes_served": self.bytes_served, "bytes_received": self.bytes_received,
                    "requests": len(self.requests)}

    def chunk_requests(self) -> list[Served]:
        with self.lock:
            return [r for r in self.requests if "/chunks/" in r.path]

    # -- used by the handler

    def _take_fault(self, method: str, path: str) -> tuple[int | None, float]:
        with self.lock:
            status = None
            for i, (st, m, sub) in enumerate(self.faults.fail):
                if (m is None or m == method) and sub in path:
                    status = st
                    del self.faults.fail[i]
                    break
            stall = self.faults.stall.pop(0) if self.faults.stall and status is None else 0.0
            if status is None and method == "PUT" and self.faults.put_budget is not None:
                if self.faults.put_budget <= 0:
                    status = 503
                else:
                    self.faults.put_budget -= 1
            return status, stall

    def _reserve(self, want: int, served: Served) -> tuple[int, str | None]:
        """How many of ``want`` body bytes may go out before a cut; counts them as served
        (before they are sent, so a client that saw them never races the counters)."""
        with self.lock:
            allowed, cut = want, None
            if self.faults.cuts and self.faults.cuts[0] < self.bytes_served + want:
                allowed = max(0, self.faults.cuts.pop(0) - self.bytes_served)
                cut = self.faults.cut_mode
            self.bytes_served += allowed
            served.body_bytes += allowed
            return allowed, cut

    def _record(self, served: Served) -> None:
        with self.lock:
            self.requests.append(served)


class _Handler(BaseHTTPRequestHandler):
    owner: RegistryServer
    protocol_version = "HTTP/1.1"  # keep-alive, as real registries and CDNs do

    def setup(self) -> None:
        super().setup()
        # As nginx's tcp_nodelay: headers and body go out in separate writes, and Nagle plus
        # the client's delayed ACK would add 40 ms to every small response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _file(self) -> Path | None:
        rel = unquote(urlparse(self.path).path).lstrip("/")
        path = (self.owner.root / rel).resolve()
        return path if path.is_relative_to(self.owner.root) else None

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        # Recorded before the client can see the answer, so tests never race the log.
        self.owner._record(Served(self.command, self.path, self.headers.get("Range"), status, 0))
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _fault(self) -> bool:
        status, stall = self.owner._take_fault(self.command, self.path)
        if stall:
            self.owner._stop.wait(stall)
        if status is not None:
            if self.command == "PUT":
                self._drain_body()
            self._reply(status, b"injected fault\n", {"Retry-After": "0"})
            return True
        return False

    def _drain_body(self) -> None:
        left = int(self.headers.get("Content-Length", "0"))
        while left:
            left -= len(self.rfile.read(min(left, _BLOCK)))

    def _control(self) -> bool:
        url = urlparse(self.path)
        if url.path == "/__stats__":
            self._reply(200, json.dumps(self.owner.stats()).encode())
        elif url.path == "/__reset__":
            self.owner.reset()
            self._reply(200)
        elif url.path == "/__cut__":
            q = parse_qs(url.query)
            self.owner.cut_at([int(x) for x in q["at"][0].split(",")], q.get("mode", ["fin"])[0])
            self._reply(200)
        else:
            return False
        return True

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        if not self._control():
            self._reply(405)

    def do_GET(self) -> None:
        if self._control() or self._fault():
            return
        if self.owner.close_each_response:
            self.close_connection = True
        if self.owner.drip_bytes_per_s:
            self._drip()
            return
        prefix = self.owner.moved_prefix
        if prefix and self.path.startswith(prefix + "/"):
            self._reply(301, headers={"Location": self.path[len(prefix):]})
            return
        path = self._file()
        if path is None or not path.is_file():
            self._reply(404)
            return
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng and self.owner.honour_range:
            m = _RANGE_RE.match(rng.strip())
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                else:  # suffix range: the last N bytes
                    start = max(0, size - int(m.group(2)))
                if start >= size:
                    self._reply(416, headers={"Content-Range": f"bytes */{size}"})
                    return
                status = 206
                if start and self.owner.resume_from_zero:
                    start = 0
        wrong_bytes = status == 206 and start > 0 and self.owner.resume_wrong_bytes
        length = end - start + 1
        served = Served(self.command, self.path, rng, status, 0)
        self.owner._record(served)
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            # wrong_bytes: the promised range, filled from the file's start (a broken cache).
            self._send_body(path, 0 if wrong_bytes else start, length, served)

    def _drip(self) -> None:
        """Headers and body, one byte at a time at the drip rate, until the client gives up."""
        path = self._file()
        body = path.read_bytes() if path is not None and path.is_file() else b"not found\n"
        status = 200 if path is not None and path.is_file() else 404
        self.owner._record(Served(self.command, self.path, self.headers.get("Range"), status, 0))
        head = (f"HTTP/1.1 {status} OK\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        pause = 1.0 / (self.owner.drip_bytes_per_s or 1.0)
        self.close_connection = True
        try:
            for i in range(len(head) + len(body)):
                byte = head[i : i + 1] if i < len(head) else body[i - len(head) : i - len(head) + 1]
                self.connection.sendall(byte)
                with self.owner.lock:
                    self.owner.bytes_served += 1
                if self.owner._stop.wait(pause):
                    return
        except OSError:
            return  # the client gave up: what the slow-retrieval tests wait for

    def _send_body(self, path: Path, start: int, length: int, served: Served) -> None:
        sent = 0
        with open(path, "rb") as f:
            while sent < length:
                allowed, cut = self.owner._reserve(min(_BLOCK, length - sent), served)
                if allowed:
                    self.connection.sendfile(f, start + sent, allowed)
                    sent += allowed
                if cut is not None:
                    self._cut(cut)
                    break

    def _cut(self, mode: str) -> None:
        self.close_connection = True
        if mode == "rst":  # linger 0: close() sends RST and drops unsent/unread bytes
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            self.connection.shutdown(socket.SHUT_WR)

    def do_PUT(self) -> None:
        if self._fault():
            return
        path = self._file()
        length = self.headers.get("Content-Length")
        if path is None or length is None:
            if length:
                self._drain_body()
            self._reply(400)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".put-{path.name}.{threading.get_ident()}")
        left = int(length)
        with open(tmp, "wb") as f:
            while left:
                block = self.rfile.read(min(left, _BLOCK))
                if not block:
                    tmp.unlink()
                    self.close_connection = True
                    return
                f.write(block)
                left -= len(block)
                with self.owner.lock:
                    self.owner.bytes_received += len(block)
        os.replace(tmp, path)
        self._reply(201)


def main() -> None:
    ap = argparse.ArgumentParser(description="Serve a registry folder over loopback HTTP.")
    ap.add_argument("--root", required=True)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    server = RegistryServer(Path(args.root), port=args.port)
    print(server.port, flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
