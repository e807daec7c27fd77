"""The registry over HTTP, as an ASGI application (what ``python -m registry.serve`` serves):
GET and HEAD of the layout with single byte ranges (206 / 416), PUT authorized per principal
and per object (:mod:`registry.write_rules`), bodies streamed to disk under a deadline, disk
work on a bounded pool of threads; and its bounds (:class:`ServerLimits`)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from registry.http_request import (
    BodyRefused,
    ClientGone,
    WorkerThreads,
    as_written,
    receive_body,
    request_length,
)
from registry.http_server import HttpLimits
from registry.principals import AuthoritySource, Principal
from registry.validation import StrictModel
from registry.write_rules import ObjectKey, Refused, RegistryFolder, parse_key

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_DRAIN_MAX = 8 << 20
"""A refused upload's body up to this size is read and dropped, so the client (which sends the
whole body before it reads the answer) sees the refusal rather than a reset connection."""
_BLOCK = 256 << 10
_LENGTH_RE = re.compile(r"^[0-9]{1,15}$")
log = logging.getLogger("registry.serve")


class ServerLimits(StrictModel):
    """Bounds of ``registry.serve``: connections, time per request, body sizes, free disk."""

    model_config = ConfigDict(frozen=True)

    workers: int = Field(default=32, ge=1, le=1024)
    """Threads for the disk work of requests (reading, hashing and storing bodies, serving
    files); connections wait for one as coroutines, not threads."""
    backlog: int = Field(default=480, ge=0)
    """Connections held beyond ``workers`` (workers + backlog at once, idle or waiting); one
    more is answered 503 at accept and closed."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's line and headers must arrive within this, counted from accept (or from the
    previous response), however they trickle in."""
    keepalive_s: float = Field(default=5.0, gt=0)
    """An idle kept-alive connection is closed after this (or after header_timeout_s, if
    shorter: the next request's head is due within it, idle time included)."""
    io_timeout_s: float = Field(default=30.0, gt=0)
    """Longest silence while a body is read or a response written."""
    min_upload_bytes_per_s: int = Field(default=16 << 10, ge=1)
    """An upload's body must arrive within io_timeout_s + its length at this rate."""
    max_chunk_bytes: int = Field(default=256 << 20, ge=4096)
    """Largest chunk body accepted (413 beyond); manifests and signatures have their own
    limits (registry.manifest.MAX_MANIFEST_BYTES, registry.signing.MAX_SIGNATURE_BYTES)."""
    min_free_bytes: int = Field(default=256 << 20, ge=0)
    """An upload that would leave less free disk than this is refused (507)."""

    def http(self) -> HttpLimits:
        """The server's bounds (:mod:`registry.http_server`); a body's own deadline grows with
        its length (:meth:`body_deadline_s`)."""
        return HttpLimits(header_timeout_s=self.header_timeout_s,
                          keep_alive_s=min(self.keepalive_s, self.header_timeout_s),
                          write_timeout_s=self.io_timeout_s,
                          max_connections=self.workers + self.backlog)

    def body_deadline_s(self, length: int) -> float:
        return self.io_timeout_s + length / self.min_upload_bytes_per_s


class _BadPath(Exception):
    """A request path that names nothing a registry could hold (400)."""


class _Answer(Exception):
    """Answer ``status`` with the one-line ``message`` (closing the connection if ``close``)."""

    def __init__(self, status: int, message: str = "", headers: dict[str, str] | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.headers, self.close = status, message, headers, close


_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="edgetrain-registry"'}


class RegistryApp:
    """The registry over HTTP, as an ASGI application: GET and HEAD of the layout (single byte
    ranges), PUT authorized per principal and per object. Disk work runs on ``limits.workers``
    threads."""

    def __init__(self, folder: RegistryFolder, authority: AuthoritySource | None,
                 private_reads: bool, limits: ServerLimits) -> None:
        self.folder, self.authority, self.private_reads = folder, authority, private_reads
        self.limits = limits
        self.threads = WorkerThreads(limits.workers)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        method = request.method
        response: Response | None
        try:
            if method in ("GET", "HEAD"):
                response = await self._get(request, body=method == "GET")
            elif method == "PUT":
                response = await self._put(request)
            else:
                raise _Answer(501, f"method {method[:20]!r} is not served: GET, HEAD, PUT",
                              close=True)
        except _Answer as a:
            response = self._answer(request, a)
        if response is not None:  # None: the client is gone, nothing to answer
            await response(scope, receive, send)

    # -- answers

    def _answer(self, request: Request, a: _Answer) -> Response:
        body = (a.message + "\n").encode() if a.message else b""
        if a.status >= 400 and a.message:
            log.warning("%s %s %s: %d %s", _client(request), request.method,
                        _target(request)[:200], a.status, a.message)
        headers = dict(a.headers or {})
        if body:
            headers["Content-Type"] = "text/plain; charset=utf-8"
        if a.close:
            headers["Connection"] = "close"
        return as_written(Response(body, a.status, headers), headers)

    async def _refuse_unread(self, request: Request, status: int, message: str,
                             length: int | None, headers: dict[str, str] | None = None) -> _Answer:
        """Refuse a PUT whose body is still on the wire: drop a small body so the connection
        stays usable and the client reads the answer; close after a large or unknown one."""
        drained = length is not None and length <= _DRAIN_MAX and await self._discard(
            request, length)
        return _Answer(status, message, headers, close=not drained)

    async def _discard(self, request: Request, length: int) -> bool:
        try:
            async for _ in receive_body(request.receive, length,
                                        timeout_s=self.limits.body_deadline_s(length),
                                        idle_s=self.limits.io_timeout_s):
                pass
        except (TimeoutError, ClientGone):
            return False
        return True

    # -- who and what

    def _object_key(self, request: Request) -> ObjectKey | None:
        """The registry object the path names; None: a well-formed path outside the layout.
        Raises _BadPath for a malformed one."""
        raw = _target(request)
        try:
            key = unquote(raw, errors="strict")[1:] if raw.startswith("/") else ""
        except UnicodeDecodeError:
            key = ""
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts) or any(
            ord(c) < 33 or c in "\\\x7f" for c in key
        ):
            raise _BadPath(f"malformed path {raw[:100]!r}")
        return parse_key(key)

    async def _principal(self, request: Request) -> Principal | None:
        if self.authority is None:
            return None
        # The files are re-read when they change: disk work, so on a worker thread.
        authority = await self.threads.run(self.authority.current)
        return authority.authenticate(request.headers.get("Authorization"))

    # -- reads

    async def _get(self, request: Request, body: bool) -> Response:
        if self.private_reads and await self._principal(request) is None:
            raise _Answer(401, "this registry needs a principal's token to read", _CHALLENGE)
        try:
            ok = self._object_key(request)
        except _BadPath as e:
            raise _Answer(400, str(e)) from None
        if ok is None:
            raise _Answer(404)
        f = await self.threads.run(_open, self.folder.path(ok))
        if f is None:
            raise _Answer(404)
        try:
            size = os.fstat(f.fileno()).st_size
            start, end, status = self._range(request, size)
        except BaseException:
            f.close()
            raise
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "Content-Length": str(end - start + 1)}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        if not body:
            f.close()
            return as_written(Response(b"", status, headers), headers)
        return as_written(StreamingResponse(self._stream(f, start, end - start + 1), status,
                                            headers), headers)

    async def _stream(self, f: IO[bytes], start: int, n: int) -> AsyncIterator[bytes]:
        try:
            await self.threads.run(f.seek, start)
            left = n
            while left > 0:
                block = await self.threads.run(f.read, min(left, _BLOCK))
                if not block:
                    return
                left -= len(block)
                yield block
        finally:
            f.close()

    def _range(self, request: Request, size: int) -> tuple[int, int, int]:
        """(first byte, last byte, status) of the answer; raises the 416."""
        rng = request.headers.get("Range")
        if not rng:
            return 0, size - 1, 200
        m = _RANGE_RE.match(rng.strip())
        start, end = 0, size - 1
        if m and m[1]:
            start = int(m[1])
            end = min(int(m[2]), size - 1) if m[2] else size - 1
        elif m and m[2]:  # suffix range: the last N bytes
            start = max(0, size - int(m[2]))
        if not m or (not m[1] and not m[2]) or start >= size or start > end:
            raise _Answer(416, headers={"Content-Range": f"bytes */{size}"})
        return start, end, 206

    # -- writes

    async def _put(self, request: Request) -> Response | None:
        text = request.headers.get("Content-Length")
        length = int(text) if text is not None and _LENGTH_RE.match(text) else None
        if self.authority is None:
            raise await self._refuse_unread(request, 403, "this registry is read-only (started "
                                            "without --principals)", length)
        who = await self._principal(request)
        if who is None:
            raise await self._refuse_unread(
                request, 401, "unknown or missing token: send 'Authorization: Bearer TOKEN' "
                "with a principal's own token", length, _CHALLENGE)
        try:
            ok = self._object_key(request)
        except _BadPath as e:
            raise _Answer(400, str(e), close=True) from None
        if ok is None:
            raise await self._refuse_unread(
                request, 403, f"{who.name}: not a registry object; only chunks, manifests, "
                "signatures and counters are stored", length)
        limit = ok.max_bytes or self.limits.max_chunk_bytes
        try:
            length = request_length(request.headers, limit)
        except BodyRefused as e:
            raise _Answer(e.status, f"{ok.key}: {e}", close=True) from None
        free = await self.threads.run(self.folder.free_bytes)
        if free - length < self.limits.min_free_bytes:
            raise _Answer(507, "the registry's disk is full", close=True)
        tmp = self.folder.incoming()
        try:  # the temporary file is gone before the client hears anything
            answer = await self._store(request, who, ok, length, tmp)
        finally:
            await self.threads.run(lambda: tmp.unlink(missing_ok=True))
        return None if answer is None else self._answer(request, answer)

    async def _store(self, request: Request, who: Principal, ok: ObjectKey, length: int,
                     tmp: Path) -> _Answer | None:
        """The answer to the upload; None if the client went away."""
        try:
            digest = await self._body_to(request, tmp, length)
            assert self.authority is not None
            authority = await self.threads.run(self.authority.current)
            status = await self.threads.run(self.folder.accept, who, authority, ok, tmp, digest)
            log.info("%s: %s stored (%d)", who.name, ok.key, status)
            return _Answer(status)
        except ClientGone:
            return None
        except TimeoutError:
            return _Answer(408, f"{ok.key}: the body did not arrive in time", close=True)
        except Refused as e:
            return _Answer(e.status, f"{who.name}: {e}")
        except OSError:  # the registry's own disk, not the client: say so, keep serving
            log.exception("%s: storing %s failed", who.name, ok.key)
            return _Answer(500, f"{ok.key}: the registry could not store it", close=True)

    async def _body_to(self, request: Request, tmp: Path, length: int) -> str:
        """Stream ``length`` body bytes into ``tmp`` (in blocks, on a worker thread); their
        sha256. TimeoutError past the body's deadline, ClientGone if the client closed."""
        sink = _HashingFile(await self.threads.run(_create, tmp))
        try:
            pending: list[bytes] = []
            held = 0
            async for chunk in receive_body(request.receive, length,
                                            timeout_s=self.limits.body_deadline_s(length),
                                            idle_s=self.limits.io_timeout_s):
                pending.append(chunk)
                held += len(chunk)
                if held >= _BLOCK:
                    await self.threads.run(sink.write, b"".join(pending))
                    pending, held = [], 0
            if pending:
                await self.threads.run(sink.write, b"".join(pending))
        finally:
            await self.threads.run(sink.close)
        return sink.hexdigest()


class _HashingFile:
    """A file being written, and the sha256 of what went into it."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f, self._sha = f, hashlib.sha256()

    def write(self, data: bytes) -> None:
        self._sha.update(data)
        self._f.write(data)

    def close(self) -> None:
        self._f.close()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _open(path: Path) -> IO[bytes] | None:
    try:
        return open(path, "rb")  # the caller closes it
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def _create(path: Path) -> IO[bytes]:
    return open(path, "xb")  # closed by _HashingFile.close


def _target(request: Request) -> str:
    """The request target as sent (before any '?'), undecoded."""
    return request.scope.get("raw_path", b"").decode("latin-1")


def _client(request: Request) -> str:
    return request.client.host if request.client else "unix"
