"""A registry served over HTTP(S): GET (with Range) to read, HEAD to probe, PUT to write
(for uploads to servers that accept them, e.g. nginx dav or pre-authorized object URLs).

The standard library's ``http.client`` gives persistent per-thread connections (one TCP/TLS
handshake per worker, not per chunk) and separate connect and read timeouts, and keeps the
device free of extra dependencies. Three things it does not do on its own are added here:
the read timeout also after it reconnects by itself (it would keep the connect timeout), a
watchdog that closes the socket when a request's deadline passes (a server dripping header
bytes never trips a read timeout), and a minimum body rate.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import ssl
import threading
from typing import Any
from urllib.parse import quote, urljoin, urlparse

from registry.errors import (
    RefError,
    ResumeMismatchError,
    StoreError,
    StoreNotFoundError,
    StoreTransientError,
    TruncatedError,
)
from registry.stores.base import RangeReader
from registry.transfer import Deadline, RateWatch, TransferConfig

TOKEN_ENV = "EDGETRAIN_REGISTRY_TOKEN"
"""Sent as ``Authorization: Bearer ...`` to HTTP(S) registries when set."""
READ_BUF = 256 << 10
_MAX_REDIRECTS = 5


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


class _HTTPConnection(_ReadTimeout, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_ReadTimeout, http.client.HTTPSConnection):
    pass


class _Watchdog:
    """Shuts a connection's socket down when the deadline passes; a blocked read returns."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: Deadline | None) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._done = False
        self._timer: threading.Timer | None = None
        if deadline is not None:
            self._timer = threading.Timer(max(0.0, deadline.remaining()), self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        with self._lock:
            self._done = True
        if self._timer is not None:
            self._timer.cancel()


class _HttpRange:
    """A response body being streamed; keeps the connection for reuse only if fully read."""

    def __init__(self, store: HttpStore, conn: http.client.HTTPConnection | None,
                 resp: http.client.HTTPResponse, size: int, remaining: int, url: str,
                 watchdog: _Watchdog) -> None:
        self._store, self._conn, self._resp = store, conn, resp
        self.size, self.remaining, self.url = size, remaining, url
        self._watchdog = watchdog
        self._rate = RateWatch(store.cfg, url)

    def readinto(self, buf: memoryview) -> int:
        if self.remaining == 0:
            return 0
        view = buf[: self.remaining]
        try:
            n = self._resp.readinto(view)
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise StoreTransientError(f"{self.url}: read failed: {type(e).__name__}: {e}") from None
        if n == 0:
            self._drop()
            raise StoreTransientError(
                f"{self.url}: connection closed with {self.remaining} bytes of the body unread"
            )
        self.remaining -= n
        self._rate.moved(n)  # SlowTransferError: the caller closes us, which drops the socket
        return n

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._store._forget(self._conn)
            self._conn = None

    def close(self) -> None:
        self._watchdog.cancel()
        if self.remaining:
            self._drop()  # unread body bytes would corrupt the next response on this connection
        self._resp.close()


class HttpStore:
    """A registry served over HTTP(S): GET (with Range) to read, HEAD to probe, PUT to write
    (for uploads to servers that accept them, e.g. nginx dav or pre-authorized object URLs)."""

    def __init__(self, base_url: str, cfg: TransferConfig | None = None) -> None:
        self.cfg = cfg or TransferConfig()
        parsed = urlparse(base_url.rstrip("/"))
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise RefError(f"{base_url!r} is not an http(s) URL")
        self.uri = base_url.rstrip("/")
        self._origin = (parsed.scheme, parsed.hostname, parsed.port)
        self._base_path = parsed.path
        token = os.environ.get(TOKEN_ENV)
        self._headers = {"Accept-Encoding": "identity", "User-Agent": "edgetrain-agent"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._local = threading.local()

    # -- connections

    def _connect(self, scheme: str, host: str, port: int | None) -> http.client.HTTPConnection:
        conn: _HTTPConnection | _HTTPSConnection
        if scheme == "https":
            conn = _HTTPSConnection(
                host, port, timeout=self.cfg.connect_timeout_s, context=ssl.create_default_context()
            )
        else:
            conn = _HTTPConnection(host, port, timeout=self.cfg.connect_timeout_s)
        conn.read_timeout_s = self.cfg.read_timeout_s
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise StoreTransientError(f"cannot connect to {host}:{port}: {e}") from None
        return conn

    def _pooled(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = self._connect(*self._origin)
        self._local.conn = conn
        return conn, False

    def _forget(self, conn: http.client.HTTPConnection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- requests

    def url(self, key: str) -> str:
        scheme, host, port = self._origin
        netloc = host if port is None else f"{host}:{port}"
        return f"{scheme}://{netloc}{self._base_path}/{quote(key)}"

    def _request(
        self, method: str, key: str, headers: dict[str, str] | None = None,
        body: bytes | None = None, deadline: Deadline | None = None,
    ) -> tuple[http.client.HTTPResponse, Any, str, _Watchdog]:
        """Send a request, following redirects.

        Returns (response, pooled conn or None, url, watchdog); the caller cancels the
        watchdog once the response is consumed.
        """
        url = self.url(key)
        hdrs = {**self._headers, **(headers or {})}
        for _ in range(_MAX_REDIRECTS + 1):
            target = urlparse(url)
            pooled = (target.scheme, target.hostname, target.port) == self._origin
            resp, conn, watchdog = self._send(method, target, hdrs, body, pooled, deadline)
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                location = urljoin(url, resp.getheader("Location", ""))
                try:
                    resp.read()
                except (OSError, http.client.HTTPException) as e:
                    self._drop(conn if pooled else None)
                    raise StoreTransientError(f"{url}: {type(e).__name__}: {e}") from None
                finally:
                    watchdog.cancel()
                if urlparse(location).scheme not in ("http", "https") or (
                    target.scheme == "https" and urlparse(location).scheme == "http"
                ):
                    raise StoreError(f"{url}: refusing redirect to {location}")
                new = urlparse(location)
                if (new.scheme, new.hostname, new.port) != (target.scheme, target.hostname,
                                                            target.port):
                    hdrs.pop("Authorization", None)  # never hand the token to another origin
                url = location
                continue
            return resp, (conn if pooled else None), url, watchdog
        raise StoreError(f"{self.url(key)}: more than {_MAX_REDIRECTS} redirects")

    def _send(
        self, method: str, target: Any, headers: dict[str, str], body: bytes | None,
        pooled: bool, deadline: Deadline | None,
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection, _Watchdog]:
        path = target.path + (f"?{target.query}" if target.query else "")
        for fresh_retry in (False, True):
            if deadline is not None and deadline.expired():
                raise deadline.error()
            if pooled:
                conn, reused = self._pooled()
            else:
                conn, reused = self._connect(target.scheme, target.hostname, target.port), False
            watchdog = _Watchdog(conn, deadline)
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                if not pooled:
                    # A one-off connection (a redirect target): the socket stays open until
                    # the response is read or closed, then goes with it.
                    conn.close()
                return resp, conn, watchdog
            except (OSError, http.client.HTTPException) as e:
                watchdog.cancel()
                conn.close()
                if pooled:
                    self._forget(conn)
                # A kept-alive connection the server already closed fails on first use: that is
                # not a failed attempt, so reconnect once without spending a retry.
                if reused and not fresh_retry and isinstance(
                    e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                ):
                    continue
                raise StoreTransientError(
                    f"{method} {target.geturl()}: {type(e).__name__}: {e}"
                ) from None
        raise AssertionError("unreachable")

    def _drop(self, conn: http.client.HTTPConnection | None) -> None:
        """Close a connection whose response was not read to the end."""
        if conn is not None:
            conn.close()
            self._forget(conn)

    def _fail(self, resp: http.client.HTTPResponse, conn: Any, url: str) -> StoreError:
        with contextlib.suppress(OSError, http.client.HTTPException):
            resp.read(64 << 10)
        if conn is not None and not resp.isclosed():
            conn.close()
            self._forget(conn)
        status = resp.status
        if status in (404, 410):
            return StoreNotFoundError(f"{url}: HTTP {status}")
        if status in (408, 425, 429) or status >= 500:
            retry_after = resp.getheader("Retry-After")
            seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
            return StoreTransientError(f"{url}: HTTP {status} {resp.reason}", seconds)
        if status in (401, 403):
            return StoreError(f"{url}: HTTP {status}: access denied (set {TOKEN_ENV}?)")
        return StoreError(f"{url}: HTTP {status} {resp.reason}")

    # -- RegistryStore protocol

    def exists(self, key: str, deadline: Deadline | None = None) -> bool:
        resp, conn, url, watchdog = self._request("HEAD", key, deadline=deadline)
        try:
            resp.read()
            if resp.status == 200:
                return True
            err = self._fail(resp, conn, url)
        except (OSError, http.client.HTTPException) as e:
            self._drop(conn)
            raise StoreTransientError(f"HEAD {url}: {type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()
        if isinstance(err, StoreNotFoundError):
            return False
        raise err

    def get(self, key: str, max_bytes: int, deadline: Deadline | None = None) -> bytes | None:
        resp, conn, url, watchdog = self._request("GET", key, deadline=deadline)
        try:
            return self._read_whole(resp, conn, url, max_bytes)
        finally:
            watchdog.cancel()

    def _read_whole(self, resp: http.client.HTTPResponse, conn: Any, url: str,
                    max_bytes: int) -> bytes | None:
        if resp.status != 200:
            err = self._fail(resp, conn, url)
            if isinstance(err, StoreNotFoundError):
                return None
            raise err
        length = resp.getheader("Content-Length")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            resp.close()
            self._drop(conn)
            raise StoreError(f"{url}: Content-Length {length[:32]!r}, over the {max_bytes}-byte "
                             "limit")
        data = bytearray()
        rate = RateWatch(self.cfg, url)
        try:
            while len(data) <= max_bytes:
                block = resp.read(min(READ_BUF, max_bytes + 1 - len(data)))
                if not block:
                    break
                data += block
                rate.moved(len(block))
        except (OSError, http.client.HTTPException, StoreTransientError) as e:
            self._drop(conn)
            if isinstance(e, StoreTransientError):
                raise
            raise StoreTransientError(f"{url}: {type(e).__name__}: {e}") from None
        if len(data) > max_bytes:
            self._drop(conn)
            raise StoreError(f"{url}: over the {max_bytes}-byte limit")
        if length is not None and len(data) != int(length):
            # read(amt) returns short at a premature close instead of raising: check ourselves.
            self._drop(conn)
            raise StoreTransientError(
                f"{url}: connection closed after {len(data)} of {length} bytes"
            )
        return bytes(data)

    def put(self, key: str, data: bytes, deadline: Deadline | None = None) -> None:
        resp, conn, url, watchdog = self._request(
            "PUT", key, {"Content-Type": "application/octet-stream"}, body=data,
            deadline=deadline,
        )
        try:
            resp.read()
        except (OSError, http.client.HTTPException) as e:
            self._drop(conn)
            raise StoreTransientError(f"PUT {url}: {type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()
        if resp.status not in (200, 201, 204):
            raise self._fail(resp, conn, url)

    def open_range(self, key: str, start: int, deadline: Deadline | None = None) -> RangeReader:
        resp, conn, url, watchdog = self._request(
            "GET", key, {"Range": f"bytes={start}-"}, deadline=deadline
        )
        try:
            return self._range_reader(resp, conn, url, start, watchdog)
        except BaseException:
            watchdog.cancel()
            raise

    def _range_reader(self, resp: http.client.HTTPResponse, conn: Any, url: str, start: int,
                      watchdog: _Watchdog) -> RangeReader:
        if resp.status == 206:
            # "bytes START-END/TOTAL": the resume point must be exactly where we asked.
            content_range = resp.getheader("Content-Range", "")
            try:
                unit_first, total = content_range.split("/")
                first = int(unit_first.split()[1].split("-")[0])
                size = int(total)
            except (ValueError, IndexError):
                first, size = -1, -1
            if first != start or size <= start:
                resp.close()
                self._drop(conn)
                message = f"{url}: asked for bytes {start}-, server answered {content_range!r}"
                if start > 0:  # a broken resume: the caller starts the object afresh
                    raise ResumeMismatchError(message)
                raise StoreError(message)
            return _HttpRange(self, conn, resp, size, size - start, url, watchdog)
        if resp.status == 200:
            length = resp.getheader("Content-Length", "")
            if not length.isdigit():
                resp.close()
                self._drop(conn)
                raise StoreError(f"{url}: no Content-Length")
            size = int(length)
            reader = _HttpRange(self, conn, resp, size, size, url, watchdog)
            _skip(reader, min(start, size))  # server ignored Range: drop what we already hold
            return reader
        if resp.status == 416:
            with contextlib.suppress(OSError, http.client.HTTPException):
                resp.read()
            if start > 0:
                raise ResumeMismatchError(f"{url}: HTTP 416 for a resume at byte {start}")
            raise TruncatedError(f"{url}: the registry's object is empty")
        raise self._fail(resp, conn, url)


def _skip(reader: RangeReader, nbytes: int) -> None:
    buf = memoryview(bytearray(min(nbytes, READ_BUF) or 1))
    while nbytes:
        nbytes -= reader.readinto(buf[: min(nbytes, len(buf))])
