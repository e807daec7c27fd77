"""What the standard library's ``http.client`` does not do on its own, for the HTTP(S) store:
a connection that keeps the read timeout also after it reconnects by itself (it would keep the
connect timeout); a watchdog that closes the socket when a request's deadline passes, or when
response headers trickle in for longer than a rate window (dripped header bytes never trip a
read timeout); and ``read_piece``, which reads a body checking a minimum rate inside every read
(``read1`` in small pieces, each blocking no longer than the rest of the window, where
``read(n)`` would wait for all n bytes).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from typing import Any

from registry.transfer import Deadline, RateWatch, TransferConfig

READ_BUF = 256 << 10


class _ReadTimeout:
    """``connect()`` with the connect timeout, then the read timeout on the open socket.

    http.client calls ``connect()`` itself when a kept-alive connection was closed by the
    server; without this the reconnected socket would keep the (shorter or longer) connect
    timeout for every later read.
    """

    read_timeout_s: float
    sock: Any

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock.settimeout(self.read_timeout_s)


class ReadTimeoutHTTPConnection(_ReadTimeout, http.client.HTTPConnection):
    pass


class ReadTimeoutHTTPSConnection(_ReadTimeout, http.client.HTTPSConnection):
    pass


class Watchdog:
    """Shuts a connection's socket down when the request's deadline passes, or when the
    response headers take longer than their limit; a blocked read or write then returns."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: Deadline | None) -> None:
        self._conn = conn
        self.sock: socket.socket | None = None
        """The request's socket: the body reads set their timeouts on it."""
        self._cond = threading.Condition()
        self._done = False
        self._ends_at = deadline.at if deadline is not None else None
        self._headers_by: float | None = None
        self._thread: threading.Thread | None = None
        self.fired: str | None = None
        """'deadline' or 'headers' once the watchdog shut the socket down."""
        self.owned: http.client.HTTPConnection | None = None
        """A one-off connection, closed with the watchdog once its response is consumed."""
        if self._ends_at is not None:
            self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="http-watchdog", daemon=True)
        self._thread.start()

    def awaiting_headers(self, limit_s: float | None) -> None:
        """The request is sent: its response headers must be complete within ``limit_s``."""
        if limit_s is None:
            return
        with self._cond:
            self._headers_by = time.monotonic() + limit_s
            self._cond.notify()
        if self._thread is None:
            self._start()

    def headers_done(self) -> None:
        with self._cond:
            self._headers_by = None
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._done:
                ends = [t for t in (self._ends_at, self._headers_by) if t is not None]
                left = min(ends) - time.monotonic() if ends else None
                if left is not None and left <= 0:
                    self._done = True
                    late = self._headers_by is not None and self._headers_by <= time.monotonic()
                    self.fired = "headers" if late else "deadline"
                    break
                self._cond.wait(left)
            else:
                return
            sock = self.sock or self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()
        if self.owned is not None:
            self.owned.close()


def read_piece(resp: http.client.HTTPResponse, sock: socket.socket | None, rate: RateWatch,
               cfg: TransferConfig, n: int) -> bytes:
    """Up to ``n`` body bytes, as soon as any arrive (``read1``: one ``recv`` at most), never
    waiting past the end of a rate window that still lacks bytes: a server dripping a body is
    dropped within the window (SlowTransferError), not when the whole body came."""
    if resp.isclosed():  # the whole body is in (its socket may be closed with it)
        return b""
    if sock is not None:
        sock.settimeout(rate.wait_s(cfg.read_timeout_s))
    try:
        data = resp.read1(n)
    except TimeoutError:
        rate.check()  # the window ended short of bytes: SlowTransferError
        raise
    if resp.length == 0:
        resp.read()  # unlike read(n), read1 leaves a finished response open: close it
    return data
