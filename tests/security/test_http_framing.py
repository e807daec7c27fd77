"""Both HTTP servers (``agentctl serve``'s Open Inference Protocol server and
``registry.serve``) against clients that abuse HTTP/1.1 itself, through real sockets on
loopback: 200 clients dripping their headers a byte a second are each cut at the header
deadline counted from accept while a normal client is served at once; conflicting framing
(two Content-Lengths, Content-Length with Transfer-Encoding) and an oversize head are answered
400 and the connection closed; a body slower than its deadline is answered 408; one
connection over the limit is answered 503 at accept; an idle kept-alive connection is closed;
a client that stops reading a large answer is cut.

Limits are small (seconds) so the tests are quick; the assertions keep wide margins over them
and claim no speed."""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.runtime.active_model import ActiveModel
from agent.runtime.oip import OipLimits, OipServer
from registry.names import chunk_key
from registry.principals import AuthoritySource
from registry.serve import make_server
from registry.serve_app import ServerLimits
from tests.support.registry_serve import provision

BLOB = bytes(range(256)) * 64
"""A chunk the registry holds: what its normal client reads."""
MARGIN_S = 3.0
"""How late past a deadline a cut may come on a loaded two-core host."""


@dataclass
class Target:
    """A server under test, and requests it answers."""

    name: str
    port: int
    normal: bytes
    """A complete request answered 200."""
    body_head: bytes
    """The head of a request whose 100-byte body the server reads (and waits for)."""
    server: Any

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


Factory = Callable[..., Target]


@pytest.fixture(params=["oip", "registry"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """target(header_s=, body_s=, keep_alive_s=, max_connections=) -> a started server."""
    opened: list[Any] = []

    def make(header_s: float = 5.0, body_s: float = 5.0, keep_alive_s: float = 5.0,
             max_connections: int = 64) -> Target:
        if request.param == "oip":
            model = ActiveModel(tmp_path / "state", "digits", poll_s=0.5)
            opened.append(model)
            limits = OipLimits(header_timeout_s=header_s, request_timeout_s=body_s,
                               keep_alive_s=keep_alive_s, max_connections=max_connections)
            server = OipServer(model, port=0, limits=limits).start()
            opened.append(server)
            return Target("oip", server.port,
                          b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
                          b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 100\r\n\r\n", server)
        root = tmp_path / "registry"
        key = chunk_key(hashlib.sha256(BLOB).hexdigest())
        (root / key).parent.mkdir(parents=True)
        (root / key).write_bytes(BLOB)
        principals, trusted, who = provision(tmp_path / "provision", ["dev-a"])
        workers = min(4, max_connections)  # the registry holds workers + backlog connections
        limits = ServerLimits(header_timeout_s=header_s, keepalive_s=keep_alive_s,
                              io_timeout_s=body_s, min_upload_bytes_per_s=10_000_000,
                              workers=workers, backlog=max_connections - workers,
                              min_free_bytes=0)
        server = make_server(root, authority=AuthoritySource(principals, trusted),
                             limits=limits).start()
        opened.append(server)
        token = who["dev-a"].token
        return Target("registry", server.port,
                      f"GET /{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
                      (f"PUT /{chunk_key('a' * 64)} HTTP/1.1\r\nHost: x\r\nContent-Length: 100"
                       f"\r\nAuthorization: Bearer {token}\r\n\r\n").encode(), server)

    yield make
    for thing in reversed(opened):
        thing.close()


def answer(s: socket.socket, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One whole response (status, headers, body) read off ``s``; ``head_only``: the answer to
    a HEAD, which has no body whatever its Content-Length says."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a whole head: {data[:200]!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    n = 0 if head_only else int(headers.get("content-length", 0))
    while len(body) < n:
        chunk = s.recv(65536)
        assert chunk, "closed before the whole body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_after(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes (fails if it does not within the time)."""
    s.settimeout(timeout_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_header_drippers_are_cut_from_accept_while_a_normal_client_is_served(
        target: Factory) -> None:
    header_s = 2.0
    t = target(header_s=header_s, max_connections=256)
    head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 200
    drippers: list[socket.socket] = []
    accepted: dict[socket.socket, float] = {}
    cut: dict[socket.socket, float] = {}
    said: dict[socket.socket, bytes] = {}
    for _ in range(200):
        s = t.connect()
        accepted[s] = time.monotonic()
        s.setblocking(False)
        drippers.append(s)
    stop = threading.Event()

    def drip() -> None:
        """One byte a second on every connection: each read is prompt, the head never ends."""
        sent = 0
        while not stop.is_set() and len(cut) < len(drippers):
            for s in drippers:
                if s not in cut:
                    with contextlib.suppress(OSError):
                        s.send(head[sent:sent + 1])
            sent += 1
            end = time.monotonic() + 1.0
            while time.monotonic() < end and len(cut) < len(drippers):
                live = [s for s in drippers if s not in cut]
                for s in select.select(live, [], [], 0.05)[0]:
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    said[s] = said.get(s, b"") + data
                    if not data:
                        cut[s] = time.monotonic()

    dripping = threading.Thread(target=drip)
    dripping.start()
    try:
        with t.connect() as normal:
            normal.sendall(t.normal)
            status, _, _ = answer(normal)
            cut_before_normal = len(cut)
        dripping.join(header_s + 2 * MARGIN_S + 5)
    finally:
        stop.set()
        dripping.join()
        for s in drippers:
            s.close()
    assert status == 200
    # Served while every dripper still held its connection: it waited for no wave of them.
    assert cut_before_normal == 0
    assert len(cut) == 200, f"{200 - len(cut)} drippers still connected"
    held = sorted(cut[s] - accepted[s] for s in drippers)
    # Counted from accept (which comes after the client's connect returns): never before the
    # deadline, and at it give or take the host's load, not after a per-read timeout renewed
    # by every byte.
    assert held[0] >= header_s - 0.05, held[:5]
    assert held[-1] <= header_s + MARGIN_S, held[-5:]
    # A partial head is told why before the close.
    assert all(said[s].startswith(b"HTTP/1.1 408 ") for s in drippers)


@pytest.mark.parametrize(("what", "request_bytes", "reason"), [
    ("conflicting Content-Length",
     b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
     b"Content-Length: 5\r\n\r\nabcde", b"conflicting Content-Length"),
    ("Content-Length and Transfer-Encoding",
     b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"both Content-Length and Transfer-Encoding"),
    ("bad chunking",
     b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"zz\r\n", b""),
    ("no Host", b"GET /v2/health/live HTTP/1.1\r\n\r\n", b"Host"),
    ("oversize head in one read",
     b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (80 << 10) + b"\r\n\r\n",
     b"request head over"),
])
def test_framing_errors_are_answered_400_and_the_connection_closed(
        target: Factory, what: str, request_bytes: bytes, reason: bytes) -> None:
    t = target()
    with t.connect() as s:
        s.sendall(request_bytes)
        out = closed_after(s)  # the server closes: nothing after it is read as a request
    assert out.startswith(b"HTTP/1.1 400 "), (what, out[:200])
    assert reason in out, out[:300]
    with t.connect() as s:  # and serves the next client
        s.sendall(t.normal)
        assert answer(s)[0] == 200


def test_an_oversize_head_sent_in_pieces_is_400_and_closed(target: Factory) -> None:
    t = target()
    with t.connect() as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(OSError):  # cut while still sending
            for _ in range(200):
                s.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
        out = closed_after(s)
    assert out.startswith(b"HTTP/1.1 400 "), out[:200]


def test_a_body_slower_than_its_deadline_is_408_and_closed(target: Factory) -> None:
    t = target(body_s=1.0)
    with t.connect() as s:
        s.sendall(t.body_head + b"x" * 10)  # 10 of 100 bytes, then silence
        status, headers, _ = answer(s)
        assert status == 408 and headers.get("connection") == "close"
        assert closed_after(s) == b""


def test_a_connection_over_the_limit_is_503_at_accept(target: Factory) -> None:
    t = target(max_connections=3)
    held = [t.connect() for _ in range(3)]
    try:
        time.sleep(0.2)  # all three accepted and holding a slot
        with t.connect() as extra:  # refused before it sends a byte
            out = closed_after(extra)
        assert out.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in out, out[:200]
        held[0].sendall(t.normal)  # the three held ones are served
        assert answer(held[0])[0] == 200
    finally:
        for s in held:
            s.close()


def test_an_idle_kept_alive_connection_is_closed(target: Factory) -> None:
    keep_alive_s = 0.5
    t = target(header_s=30.0, keep_alive_s=keep_alive_s)
    with t.connect() as s:
        s.sendall(t.normal)
        assert answer(s)[0] == 200
        idle_from = time.monotonic()
        assert closed_after(s, timeout_s=keep_alive_s + MARGIN_S) == b""  # closed, nothing said
        assert time.monotonic() - idle_from >= keep_alive_s - 0.05


def test_a_client_that_stops_reading_a_large_answer_is_cut(tmp_path: Path) -> None:
    root = tmp_path / "registry"
    big = b"\0" * (64 << 20)
    key = chunk_key(hashlib.sha256(big).hexdigest())
    (root / key).parent.mkdir(parents=True)
    (root / key).write_bytes(big)
    limits = ServerLimits(io_timeout_s=1.0, header_timeout_s=5.0, keepalive_s=5.0)
    with make_server(root, limits=limits).start() as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"GET /{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            time.sleep(1.0 + MARGIN_S)  # reads nothing: the server's writes stall
            got = closed_after(s)  # what was in flight, then the reset
        assert len(got) < len(big), "the whole answer went to a client that read nothing"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"HEAD /{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert answer(s, head_only=True)[0] == 200
