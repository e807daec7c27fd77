"""The HTTP/1.1 servers of this repository (``python -m registry.serve``, ``agentctl serve``):
an ASGI application on uvicorn, with every connection, request head, body and response write
bounded.

uvicorn parses with h11, which answers a framing error 400 and closes (conflicting
Content-Length headers, bad chunking, a head over ``max_head_bytes``; RFC 9112 §6.3); here a
request with both Content-Length and Transfer-Encoding is refused the same way. It holds an
idle connection as a coroutine, not a thread, so a few hundred of them cost a few MiB. What
uvicorn does not bound by itself is added by :class:`_BoundedH11Protocol`:

- the whole request head must arrive within ``header_timeout_s`` counted from accept (and,
  on a kept-alive connection, from the end of the previous response): uvicorn's own keep-alive
  timer is cancelled by the first byte, so a client dripping one byte a second would otherwise
  hold its connection for ever;
- one connection over ``max_connections`` is answered 503 at accept and closed;
- a response the client stops reading is cut after ``write_timeout_s`` without progress.

A body is the application's to read, under a deadline, after checking its length; blocking
work goes to a bounded pool of threads, so the event loop never waits on a disk or a model
(:mod:`registry.http_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import signal
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import h11
import uvicorn
from pydantic import ConfigDict, Field, model_validator
from uvicorn.protocols.http.h11_impl import H11Protocol

from registry.validation import StrictModel

log = logging.getLogger("registry.http_server")
ASGIApp = Callable[..., Any]

_BUSY_BODY = json.dumps({"error": "server busy: every connection slot is taken, retry"}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Retry-After: 1\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
         % (len(_BUSY_BODY), _BUSY_BODY))
_LATE_BODY = b"the request head did not arrive in time\n"
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_LATE_BODY), _LATE_BODY))
_LISTEN_BACKLOG = 1024
"""The kernel's queue of connections not yet accepted: a burst of clients is accepted (and
answered 503 past the limit) rather than left in SYN retransmits."""


class HttpLimits(StrictModel):
    """What a connection, a request head and the server as a whole may take. A body's size and
    deadline are the application's to set, per route (:mod:`registry.http_request`)."""

    model_config = ConfigDict(frozen=True)

    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's line and headers must all arrive within this, counted from accept (and from
    the end of the previous response on a kept-alive connection), however they trickle in."""
    keep_alive_s: float = Field(default=5.0, gt=0)
    """An idle kept-alive connection is closed after this."""
    write_timeout_s: float = Field(default=30.0, gt=0)
    """A response the client stops reading is cut after this long without progress."""
    max_connections: int = Field(default=512, ge=1)
    """Client connections held at once; one more is answered 503 at accept and closed."""
    max_head_bytes: int = Field(default=64 << 10, ge=1024)
    """Largest request line plus headers; a larger head is answered 400 and closed."""

    @model_validator(mode="after")
    def _idle_within_head(self) -> HttpLimits:
        if self.keep_alive_s > self.header_timeout_s:
            raise ValueError(
                f"keep_alive_s={self.keep_alive_s} is over header_timeout_s="
                f"{self.header_timeout_s}: the next request's head is due within "
                "header_timeout_s of the previous response, idle time included; give "
                "keep_alive_s <= header_timeout_s")
        return self


# -- the protocol: h11 with the deadlines and the bound uvicorn lacks ----------------------------


class _StrictH11(h11.Connection):
    """h11, refusing also a request that carries both Content-Length and Transfer-Encoding
    (the two framings disagreeing is how requests are smuggled past a proxy, RFC 9112 §6.3)
    and a head over ``max_head_bytes`` that came in one read (h11 bounds only an incomplete
    one); :attr:`error` keeps why the last request was refused."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.error = ""

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                self._check(event)
        except h11.RemoteProtocolError as e:
            self.error = str(e)
            raise
        return event

    def _check(self, request: h11.Request) -> None:
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding")
        size = len(request.method) + len(request.target) + 12 + sum(
            len(name) + len(value) + 4 for name, value in request.headers)
        if size > self.max_head_bytes:
            raise h11.RemoteProtocolError(f"request head over {self.max_head_bytes} bytes")


class _BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a whole-head deadline, an accept-time connection bound and
    a write-stall timeout. :class:`HttpServer` makes a subclass carrying its ``limits``."""

    limits: HttpLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn: _StrictH11 = _StrictH11(self.limits.max_head_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_cycle: object = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Refused at accept, before a byte is read: the slot goes to a served client.
            self.connections.discard(self)
            self._refused = True
            transport.write(_BUSY)
            transport.close()
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(f"{msg.rstrip('.')}: {self.conn.error}\n"
                                  if self.conn.error else msg)

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._cancel_head_timer()  # a new request's head is in: the app has it now

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            # The next head is due within header_timeout_s from now (uvicorn's keep-alive timer
            # alone is cancelled by a first byte).
            self._arm_head_timer()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s,
                                                     self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        started = bool(self.conn.trailing_data[0])
        log.debug("%s: no request head within %.1f s: closed", _peer(self.client),
                  self.limits.header_timeout_s)
        if started:  # part of a head came: say why (a silent idle connection is just closed)
            self.transport.write(_TIMED_OUT)
        self.transport.close()

    def _write_stalled(self) -> None:
        self._write_timer = None
        log.info("%s: the response was not read for %.1f s: connection cut",
                 _peer(self.client), self.limits.write_timeout_s)
        sock = self.transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            # A reset, not a close: the kernel drops the unsent bytes now rather than keep
            # them (megabytes) for a peer that does not read.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # close() would wait for the unread buffer to drain


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unix"


# -- the server ----------------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling :class:`HttpServer` when it listens; signals are
    :meth:`HttpServer.serve_forever`'s to handle, not uvicorn's (which re-raises them after
    a clean stop, turning SIGTERM into death by signal)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = threading.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


def clear_stale_socket(path: Path) -> None:
    """Remove a Unix socket left by a dead server; refuse a live one or anything else."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_socket():
        raise FileExistsError(f"{path} exists and is not a socket: choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
            return
    raise OSError(f"another server listens on {path}")


def _listen_unix(path: Path, mode: int) -> socket.socket:
    clear_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        path.chmod(mode)  # before listen(): nobody connects while the mode is the umask's
        sock.listen(_LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def _listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=_LISTEN_BACKLOG)


def _room_for(connections: int) -> None:
    """Raise this process's open-file limit (soft, up to the hard one) to hold ``connections``
    sockets beside its other files; warn if the hard limit is too low."""
    want = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft < want:
        log.warning("open files limited to %d: %d connections may not all be accepted (raise "
                    "LimitNOFILE)", soft, connections)


class HttpServer:
    """``app`` (ASGI 3) on ``host:port`` (TCP; 0: a free port) or on the Unix socket ``uds``
    (mode ``uds_mode``), bounded by ``limits``. The socket is bound here, so :attr:`port` is
    known at once; :meth:`start` serves from a thread, :meth:`serve_forever` from the caller's
    until SIGTERM or SIGINT (or :meth:`shutdown`)."""

    def __init__(self, app: ASGIApp, *, limits: HttpLimits, host: str = "127.0.0.1",
                 port: int = 0, uds: Path | None = None, uds_mode: int = 0o660,
                 name: str = "edgetrain", drain_s: float = 5.0) -> None:
        self.limits, self.uds = limits, None if uds is None else Path(uds)
        _room_for(limits.max_connections)
        self._sock = _listen_tcp(host, port) if self.uds is None else _listen_unix(self.uds,
                                                                                    uds_mode)
        self._host = host
        protocol = type("BoundedH11Protocol", (_BoundedH11Protocol,), {"limits": limits})
        config = uvicorn.Config(
            app, http=protocol, ws="none", lifespan="off", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            headers=[("server", name)], timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=drain_s,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=limits.max_head_bytes,
        )
        self._server = _Uvicorn(config)
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def port(self) -> int:
        """The TCP port (0 on a Unix socket)."""
        return 0 if self.uds is not None else int(self._sock.getsockname()[1])

    @property
    def address(self) -> str:
        """``http://host:port`` or ``unix:PATH``."""
        if self.uds is not None:
            return f"unix:{self.uds}"
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        """Client connections held now (at most ``limits.max_connections``)."""
        return len(self._server.server_state.connections)

    def start(self) -> HttpServer:
        """Serve from a thread; returns once listening."""
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self._thread.start()
        while not self._server.listening.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.address} did not start")
        return self

    def serve_forever(self) -> None:
        """Serve from this thread until SIGTERM or SIGINT (in the main thread) or
        :meth:`shutdown`; then stop accepting, finish the requests in flight (``drain_s`` at
        most) and close."""
        handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._run()
        finally:
            for sig, old in handlers.items():
                signal.signal(sig, old)
            self._cleanup()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        self._server.should_exit = True

    def _run(self) -> None:
        self._server.run(sockets=[self._sock])

    def shutdown(self) -> None:
        """End :meth:`serve_forever` or the :meth:`start`-ed thread (from another thread)."""
        self._server.should_exit = True

    def close(self) -> None:
        """Stop accepting, finish the requests in flight (``drain_s`` at most), close."""
        self.shutdown()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._cleanup()

    def _cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        if self.uds is not None:
            self.uds.unlink(missing_ok=True)

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
