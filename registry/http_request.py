"""What an ASGI application on :mod:`registry.http_server` uses to take a request: its body's
length checked on the headers (:func:`request_length`), the body read under a deadline
(:func:`receive_body`), blocking work on a bounded pool of threads (:class:`WorkerThreads`)
and header names in their written case (:func:`as_written`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from starlette.responses import Response

T = TypeVar("T")
R = TypeVar("R", bound=Response)


class BodyRefused(Exception):
    """A request body refused on its headers: ``status`` is the answer (400, 411, 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client closed its connection before the whole body came."""


def request_length(headers: Mapping[str, str], max_bytes: int) -> int:
    """The body's length from its headers: Content-Length is required (a chunked body is not
    taken) and at most ``max_bytes``. Raises :class:`BodyRefused` before a byte is read."""
    text = headers.get("content-length")
    if text is None or headers.get("transfer-encoding"):
        raise BodyRefused(411, "Content-Length is required (a chunked body is not taken)")
    if not text.strip().isdigit() or len(text) > 15:
        raise BodyRefused(400, f"Content-Length {text[:32]!r} is not a byte count")
    n = int(text)
    if n > max_bytes:
        raise BodyRefused(413, f"body of {n} bytes is over the server's limit of {max_bytes}")
    return n


async def receive_body(receive: Callable[[], Any], length: int, *, timeout_s: float,
                       idle_s: float | None = None) -> AsyncIterator[bytes]:
    """The ``length`` bytes of a request body, as they arrive: all within ``timeout_s``, none
    after more than ``idle_s`` of silence. TimeoutError past either; :class:`ClientGone` if the
    client closes first."""
    deadline = time.monotonic() + timeout_s
    left = length
    while left > 0:
        wait = deadline - time.monotonic()
        if idle_s is not None:
            wait = min(wait, idle_s)
        if wait <= 0:
            raise TimeoutError("the request body did not arrive in time")
        try:
            message = await asyncio.wait_for(receive(), wait)
        except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
            raise TimeoutError("the request body did not arrive in time") from None
        if message["type"] == "http.disconnect":
            raise ClientGone(f"the client closed with {left} of {length} body bytes unsent")
        chunk = message.get("body", b"")
        if chunk:
            left -= len(chunk)
            yield chunk
        if not message.get("more_body", False) and left > 0:
            raise ClientGone(f"the body ended {left} bytes short of Content-Length")


async def read_body(receive: Callable[[], Any], length: int, *, timeout_s: float) -> bytes:
    """The whole body (:func:`receive_body`), for one that fits in memory."""
    return b"".join([c async for c in receive_body(receive, length, timeout_s=timeout_s)])


def as_written(response: R, headers: Mapping[str, str]) -> R:
    """``response`` with the names of ``headers`` in their case as written (Starlette lowers
    them): HTTP says case does not matter, yet clients that look a header up by its exact
    name (``Content-Range``) exist."""
    names = {k.lower().encode("latin-1"): k.encode("latin-1") for k in headers}
    response.raw_headers = [(names.get(k, k), v) for k, v in response.raw_headers]
    return response


class WorkerThreads:
    """At most ``n`` threads for the blocking work of requests (disk, inference), called from
    the event loop, which goes on serving other connections meanwhile."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._limiter = anyio.CapacityLimiter(n)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of the threads; waits for a free one."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
