"""An HTTP/1.1 server whose every connection, thread and read has a bound.

The standard library's ``ThreadingHTTPServer`` starts a thread per connection and reads with
no deadline, so 300 half-open requests hold 300 threads for ever. Here a fixed pool of
workers serves connections from a short queue (beyond it: 503 at once), a request's line and
headers must arrive within a deadline (a client dripping one byte at a time is cut at it, not
at a per-read timeout it keeps resetting), an idle kept-alive connection frees its worker
after a few seconds, and every read and write on the socket has a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("registry.serve")
_RECV = 256 << 10
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
         b"Connection: close\r\n\r\n")


class ServerLimits(BaseModel):
    """Bounds of ``registry.serve``: connections, time per request, body sizes, free disk."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    workers: int = Field(default=32, ge=1, le=1024)
    """Connections served at once (one thread each, started up front)."""
    backlog: int = Field(default=64, ge=0)
    """Accepted connections waiting for a worker; one more is answered 503 and closed."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's line and headers must arrive within this, however they trickle in."""
    keepalive_s: float = Field(default=5.0, gt=0)
    """An idle kept-alive connection is closed after this, freeing its worker."""
    io_timeout_s: float = Field(default=30.0, gt=0)
    """Longest silence while a body is read or a response written."""
    min_upload_bytes_per_s: int = Field(default=16 << 10, ge=1)
    """An upload's body must arrive within io_timeout_s + its length at this rate."""
    max_chunk_bytes: int = Field(default=256 << 20, ge=4096)
    """Largest chunk body accepted (413 beyond); manifests and signatures have their own
    limits (registry.manifest.MAX_MANIFEST_BYTES, registry.signing.MAX_SIGNATURE_BYTES)."""
    min_free_bytes: int = Field(default=256 << 20, ge=0)
    """An upload that would leave less free disk than this is refused (507)."""


class DeadlineReader:
    """The connection's read side, in place of the buffered file: every read waits at most
    until the armed deadline, summed over all the ``recv`` calls it takes."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._deadline = float("inf")
        self._idle_s = 30.0

    def arm(self, seconds: float, idle_s: float) -> None:
        """Reads from now must finish within ``seconds``; none may wait more than ``idle_s``."""
        self._deadline = time.monotonic() + seconds
        self._idle_s = idle_s

    def wait_for_data(self, seconds: float) -> bool:
        """True once a byte is buffered; False if none came within ``seconds`` or the peer
        closed (the keep-alive wait)."""
        if self._buf:
            return True
        self._deadline = time.monotonic() + seconds
        try:
            return self._fill()
        except (TimeoutError, OSError):
            return False

    def _fill(self) -> bool:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self._sock.settimeout(min(left, self._idle_s))
        data = self._sock.recv(_RECV)
        if not data:
            return False
        self._buf += data
        return True

    def readline(self, limit: int = -1) -> bytes:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0 and (limit < 0 or end < limit):
                return self._take(end + 1)
            if limit >= 0 and len(self._buf) >= limit:
                return self._take(limit)
            if not self._fill():
                return self._take(len(self._buf))

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes: what is buffered, or one ``recv``; b'' at end of stream."""
        if not self._buf and n > 0 and not self._fill():
            return b""
        return self._take(min(n, len(self._buf)))

    def _take(self, n: int) -> bytes:
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def close(self) -> None:
        self._buf.clear()


class BoundedHandler(BaseHTTPRequestHandler):
    """Reads through a :class:`DeadlineReader`; subclasses read ``limits``."""

    protocol_version = "HTTP/1.1"
    limits: ServerLimits
    rfile: DeadlineReader  # type: ignore[assignment]

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = DeadlineReader(self.connection)
        # Headers and body go out in separate writes; Nagle + delayed ACK would add 40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._requests = 0

    def handle_one_request(self) -> None:
        wait = self.limits.keepalive_s if self._requests else self.limits.header_timeout_s
        if not self.rfile.wait_for_data(wait):
            self.close_connection = True
            return
        self._requests += 1
        self.rfile.arm(self.limits.header_timeout_s, self.limits.header_timeout_s)
        super().handle_one_request()

    def end_headers(self) -> None:
        # From here the socket writes: a reader that stops reading is cut after the timeout.
        self.connection.settimeout(self.limits.io_timeout_s)
        super().end_headers()


class BoundedHTTPServer(HTTPServer):
    """``workers`` threads serve accepted connections from a queue of at most ``backlog``."""

    # The kernel's queue of connections not yet accepted (socketserver's default is 5: a
    # burst of clients would see dropped SYNs and 1 s retransmits before any 503).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BoundedHandler],
                 limits: ServerLimits) -> None:
        self.limits = limits
        self._queue: queue.Queue[tuple[Any, Any] | None] = queue.Queue()
        super().__init__(address, handler)
        self._workers = [threading.Thread(target=self._work, name=f"registry-worker-{i}",
                                          daemon=True) for i in range(limits.workers)]
        for t in self._workers:
            t.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        # Only this (accepting) thread puts, so the size check cannot race another put.
        if self._queue.qsize() >= self.limits.backlog:
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        self._queue.put((request, client_address))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # the peer went away or timed out: its problem alone
            log.info("%s: connection dropped: %s", client_address[0], error)
        else:
            log.exception("%s: request failed", client_address[0])

    def server_close(self) -> None:
        super().server_close()
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    self.shutdown_request(item[0])
        for _ in self._workers:
            self._queue.put(None)
