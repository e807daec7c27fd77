"""A registry served over HTTP(S): GET (with Range) to read, HEAD to probe, PUT to write
(for uploads to servers that accept them, e.g. nginx dav or pre-authorized object URLs).

The standard library's ``http.client`` gives persistent per-thread connections (one TCP/TLS
handshake per worker, not per chunk) and separate connect and read timeouts, and keeps the
device free of extra dependencies. What it does not do on its own is added beside it: the
read timeout also after it reconnects by itself (it would keep the connect timeout); a
watchdog that closes the socket when a request's deadline passes, or when response headers
trickle in for longer than a rate window (dripped header bytes never trip a read timeout); a
minimum body rate checked inside every read (``read1`` in small pieces, each blocking no
longer than the rest of the window, where ``read(n)`` would wait for all n bytes); and
credentials sent only where :mod:`registry.credentials` allows.

This module is the store: ``HttpStore``'s reads and writes (HEAD, GET, Range, PUT) and the
streamed body of a range. Its connections, requests and error answers are ``HttpClient``
(``registry.stores.http_client``); the socket-level additions above are
``registry.stores.http_transport``.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
from typing import Any

from registry.errors import (
    ResumeMismatchError,
    StoreError,
    StoreNotFoundError,
    StoreTransientError,
    TruncatedError,
)
from registry.stores.base import RangeReader
from registry.stores.http_client import HttpClient
from registry.stores.http_transport import READ_BUF, Watchdog, read_piece
from registry.transfer import Deadline, RateWatch


class _HttpRange:
    """A response body being streamed; keeps the connection for reuse only if fully read."""

    def __init__(self, store: HttpStore, conn: http.client.HTTPConnection | None,
                 resp: http.client.HTTPResponse, size: int, remaining: int, url: str,
                 watchdog: Watchdog) -> None:
        self._store, self._conn, self._resp = store, conn, resp
        self.size, self.remaining, self.url = size, remaining, url
        self._watchdog = watchdog
        self._rate = RateWatch(store.cfg, url)

    def readinto(self, buf: memoryview) -> int:
        if self.remaining == 0:
            return 0
        try:
            data = read_piece(self._resp, self._watchdog.sock, self._rate, self._store.cfg,
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


class HttpStore(HttpClient):
    """A registry served over HTTP(S): GET (with Range) to read, HEAD to probe, PUT to write
    (for uploads to servers that accept them, e.g. nginx dav or pre-authorized object URLs)."""

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
                block = read_piece(resp, sock, rate, self.cfg,
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
                      watchdog: Watchdog) -> RangeReader:
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
