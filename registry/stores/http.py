"""A registry served over HTTP(S): GET (with Range) to read, HEAD to probe, PUT to write
(for uploads to servers that accept them, e.g. nginx dav or pre-authorized object URLs).

The standard library's ``http.client`` gives persistent per-thread connections (one TCP/TLS
handshake per worker, not per chunk) and separate connect and read timeouts, and keeps the
device free of extra dependencies. What it does not do on its own is added here: the read
timeout also after it reconnects by itself (it would keep the connect timeout); a watchdog
that closes the socket when a request's deadline passes, or when response headers trickle in
for longer than a rate window (dripped header bytes never trip a read timeout); a minimum body
rate checked inside every read (``read1`` in small pieces, each blocking no longer than the rest
of the window, where ``read(n)`` would wait for all n bytes); and credentials sent only where
:mod:`registry.credentials` allows.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import quote, urljoin, urlparse

from registry.credentials import REGISTRY_ENV, TOKEN_ENV, RegistryCredential, credential_from_env
from registry.errors import (
    RefError,
    ResumeMismatchError,
    SlowTransferError,
    StoreConflictError,
    StoreError,
    StoreNotFoundError,
    StoreTransientError,
    TruncatedError,
)
from registry.stores.base import RangeReader
from registry.transfer import Deadline, RateWatch, TransferConfig

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
        try:
            data = _read_piece(self._resp, self._watchdog.sock, self._rate, self._store.cfg,
                               min(len(buf), self.remaining))
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise StoreTransientError(f"{self.url}: read failed: {type(e).__name__}: {e}") from None
        n = len(data)
        if n == 0:
            self._drop()
            raise StoreTransientError(
                f"{self.url}: connection closed with {self.remaining} bytes of the body unread"
            )
        buf[:n] = data
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

    def __init__(self, base_url: str, cfg: TransferConfig | None = None,
                 credential: RegistryCredential | None = None) -> None:
        """``credential``: the configured registry's token (default: ``$EDGETRAIN_REGISTRY_TOKEN``
        for ``$EDGETRAIN_REGISTRY``); sent only if this store is that registry's origin."""
        self.cfg = cfg or TransferConfig()
        parsed = urlparse(base_url.rstrip("/"))
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise RefError(f"{base_url!r} is not an http(s) URL")
        self.uri = base_url.rstrip("/")
        self._origin = (parsed.scheme, parsed.hostname, parsed.port)
        self._base_path = parsed.path
        self._credential = credential if credential is not None else credential_from_env()
        self._headers = {"Accept-Encoding": "identity", "User-Agent": "edgetrain-agent"}
        self._reads_need_token = False
        """Set once this server answered a read with 401: its reads carry the token from then."""
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

    def _auth(self, method: str, url: str) -> dict[str, str]:
        """The token, only on requests that need it and only to the credential's origin."""
        if self._credential is None or (method != "PUT" and not self._reads_need_token):
            return {}
        return self._credential.header_for(url)

    def _request(
        self, method: str, key: str, headers: dict[str, str] | None = None,
        body: bytes | None = None, deadline: Deadline | None = None,
    ) -> tuple[http.client.HTTPResponse, Any, str, _Watchdog]:
        """Send a request, following redirects (and one 401 challenge on a read).

        Returns (response, pooled conn or None, url, watchdog); the caller cancels the
        watchdog once the response is consumed.
        """
        url = self.url(key)
        redirects = 0
        while True:
            target = urlparse(url)
            pooled = (target.scheme, target.hostname, target.port) == self._origin
            auth = self._auth(method, url)
            hdrs = {**self._headers, **(headers or {}), **auth}
            resp, conn, watchdog = self._send(method, target, hdrs, body, pooled, deadline)
            retry_with_token = (
                resp.status == 401 and not auth and self._credential is not None
                and self._credential.header_for(url)
                and "bearer" in resp.getheader("WWW-Authenticate", "").lower()
            )
            redirect = resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location")
            if not (retry_with_token or redirect):
                return resp, (conn if pooled else None), url, watchdog
            try:
                resp.read(64 << 10)
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn if pooled else None)
                raise StoreTransientError(f"{url}: {type(e).__name__}: {e}") from None
            finally:
                watchdog.cancel()
            if not resp.isclosed():  # a body too long to skip: the connection goes with it
                self._drop(conn if pooled else None)
            if retry_with_token:
                self._reads_need_token = True  # this server keeps its reads private
                continue
            redirects += 1
            if redirects > _MAX_REDIRECTS:
                raise StoreError(f"{self.url(key)}: more than {_MAX_REDIRECTS} redirects")
            location = urljoin(url, resp.getheader("Location", ""))
            if urlparse(location).scheme not in ("http", "https") or (
                target.scheme == "https" and urlparse(location).scheme == "http"
            ):
                raise StoreError(f"{url}: refusing redirect to {location}")
            url = location  # the token follows only if it is the credential's origin

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
                if conn.sock is not None:  # body reads shortened it to the rest of a window
                    conn.sock.settimeout(self.cfg.read_timeout_s)
                conn.request(method, path, body=body, headers=headers)
                watchdog.sock = conn.sock
                watchdog.awaiting_headers(self._header_limit_s())
                resp = conn.getresponse()
                watchdog.headers_done()
                if not pooled:
                    # A one-off connection (a redirect target) lives until its response is
                    # consumed: closing it now would close the response with it.
                    watchdog.owned = conn
                return resp, conn, watchdog
            except (OSError, http.client.HTTPException) as e:
                watchdog.cancel()
                conn.close()
                if pooled:
                    self._forget(conn)
                if watchdog.fired == "headers":
                    raise SlowTransferError(
                        f"{method} {target.geturl()}: response headers still incomplete after "
                        f"{self._header_limit_s():g} s: the server drips them"
                    ) from None
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

    def _header_limit_s(self) -> float | None:
        """How long response headers may take once the request is sent: one rate window (a
        few hundred bytes that take a whole window are far below any minimum rate; a silent
        server is cut sooner by the read timeout if that is shorter)."""
        return self.cfg.min_rate_window_s if self.cfg.min_rate_bytes_per_s else None

    def _drop(self, conn: http.client.HTTPConnection | None) -> None:
        """Close a connection whose response was not read to the end."""
        if conn is not None:
            conn.close()
            self._forget(conn)

    def _fail(self, resp: http.client.HTTPResponse, conn: Any, url: str,
              said: bytes = b"") -> StoreError:
        """The error for a non-success answer; ``said``: its body, if already read."""
        with contextlib.suppress(OSError, http.client.HTTPException):
            said = said or resp.read(64 << 10)
        if conn is not None and not resp.isclosed():
            conn.close()
            self._forget(conn)
        status = resp.status
        # The server's one-line reason (registry.serve says what it refused and why).
        reason = "".join(c for c in said[:300].decode("utf-8", "replace") if c.isprintable())
        message = f"{url}: HTTP {status} {resp.reason}" + (f": {reason.strip()}" if reason else "")
        if status in (404, 410):
            return StoreNotFoundError(message)
        if status in (408, 425, 429) or status >= 500:
            retry_after = resp.getheader("Retry-After")
            seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
            return StoreTransientError(message, seconds)
        if status == 409:
            return StoreConflictError(message)
        cred = self._credential
        if status in (401, 403) and cred is None:
            return StoreError(f"{message} (no registry token configured: set {TOKEN_ENV} with "
                              f"{REGISTRY_ENV}={self.uri})")
        if status in (401, 403) and cred is not None and not cred.header_for(url):
            return StoreError(f"{message} (the configured token is for {cred.registry}, and is "
                              "sent nowhere else)")
        return StoreError(message)

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
            return self._read_whole(resp, conn, url, max_bytes, watchdog.sock)
        finally:
            watchdog.cancel()

    def _read_whole(self, resp: http.client.HTTPResponse, conn: Any, url: str,
                    max_bytes: int, sock: socket.socket | None) -> bytes | None:
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
                block = _read_piece(resp, sock, rate, self.cfg,
                                    min(READ_BUF, max_bytes + 1 - len(data)))
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
            said = resp.read(64 << 10)
        except (OSError, http.client.HTTPException) as e:
            self._drop(conn)
            raise StoreTransientError(f"PUT {url}: {type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()
        if resp.status not in (200, 201, 204):
            raise self._fail(resp, conn, url, said)
        if not resp.isclosed():  # an answer too long to be one: do not reuse the connection
            self._drop(conn)

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


def _read_piece(resp: http.client.HTTPResponse, sock: socket.socket | None, rate: RateWatch,
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
