"""The Open Inference Protocol (KServe v2, Triton's HTTP/REST) in front of an
:class:`~agent.runtime.active_model.ActiveModel`, on a loopback TCP port or a Unix socket.

    GET  /v2/health/live                 200 {"live": true}
    GET  /v2/health/ready                200 {"ready": true} once a version serves, else 400
    GET  /v2                             server metadata
    GET  /v2/models/NAME[/versions/V]    model metadata: versions, platform, inputs, outputs
    GET  /v2/models/NAME[/versions/V]/ready
    POST /v2/models/NAME[/versions/V]/infer    (JSON, or the binary tensor data extension)
    POST /v2/models/NAME/record          not in the protocol: the infer body, plus
                                         ``parameters.label`` (an int, optional); the samples
                                         go to the spool the model was given (404 without)

Errors are ``{"error": "..."}``: 400 a request the model cannot take, 404 an unknown model,
version or route (or no spool, for record), 405 a wrong method, 408 a body not received in
time, 411 no Content-Length, 413 a body over the limit, 415 a compressed body, 503 no
version serving yet (or every connection slot busy). Ready answers 400 when not ready, as
the protocol says ("a 4xx status indicates false").

Every resource is bounded (:class:`OipLimits`): body bytes (Content-Length required, checked
before a byte of the body is read), connections served at once (one more is answered 503 and
closed) and a timeout on each read from a client and on the whole body, so a slow or silent
client holds a thread for seconds, not forever. Standard library only (``http.server``):
nothing to install on a device.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field

from agent.runtime.active_model import ActiveModel, NoSpoolError
from agent.runtime.oip_codec import HEADER_LENGTH, ProtocolError, encode_infer, parse_infer
from agent.runtime.oip_request import ModelSignature
from registry.errors import NoActiveModelError

log = logging.getLogger("agent.runtime.oip")

Response = tuple[int, bytes, dict[str, str]]


class OipLimits(BaseModel):
    """What one request and the server as a whole may take."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    max_body_bytes: int = Field(default=16 << 20, ge=1024)
    """Largest request body (bytes); a larger Content-Length is answered 413 unread."""
    max_connections: int = Field(default=32, ge=1)
    """Client connections served at once; one more is answered 503 and closed."""
    request_timeout_s: float = Field(default=10.0, gt=0)
    """Longest wait for any read from a client (an idle keep-alive connection too), and for
    a whole request body."""


def _version() -> str:
    try:
        return importlib.metadata.version("edgetrain")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def _json(status: int, doc: dict[str, Any]) -> Response:
    return status, json.dumps(doc, allow_nan=False).encode(), {"Content-Type": "application/json"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: tritonclient reuses its connections
    server: _Server

    # Buffered: the status line, headers and body leave in one write (flushed after each
    # request), so Nagle's algorithm never holds a body back behind a delayed ACK.
    wbufsize = -1

    def setup(self) -> None:
        self.timeout = self.server.limits.request_timeout_s
        super().setup()
        if self.server.address_family != socket.AF_UNIX:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def version_string(self) -> str:
        return "edgetrain-oip"  # not the Python version http.server would add

    def address_string(self) -> str:
        return str(self.client_address[0]) if isinstance(self.client_address, tuple) else "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        self._body_read = method != "POST"
        try:
            # The body first, whatever the route: an error answered with the body unread
            # would have to close the connection (the rest would parse as the next request).
            request = self._body() if method == "POST" else b""
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            status, body, headers = self._route(method, parts, request)
        except ProtocolError as e:
            status, body, headers = _json(e.status, {"error": str(e)})
        except NoActiveModelError as e:
            status, body, headers = _json(503, {"error": str(e)})
        except NoSpoolError as e:
            status, body, headers = _json(404, {"error": str(e)})
        except ValueError as e:  # what ActiveModel.predict refuses (shape, dtype)
            status, body, headers = _json(400, {"error": str(e)})
        except TimeoutError:
            self.close_connection = True
            status, body, headers = _json(408, {"error": "request not received in time"})
        except Exception as e:  # one bad request never takes the server down
            log.exception("%s %s failed", method, self.path)
            status, body, headers = _json(500, {"error": f"internal error: {e}"})
        if not self._body_read:  # an unread body would be parsed as the next request
            self.close_connection = True
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _route(self, method: str, parts: list[str], body: bytes) -> Response:
        model = self.server.model
        if parts[:2] == ["v2", "health"] and len(parts) == 3 and parts[2] in ("live", "ready"):
            self._method(method, "GET")
            if parts[2] == "live":
                return _json(200, {"live": True})
            ready = model.version is not None
            return _json(200 if ready else 400, {"ready": ready})
        if parts == ["v2"]:
            self._method(method, "GET")
            return _json(200, {"name": "edgetrain", "version": _version(),
                               "extensions": ["binary_tensor_data"]})
        if parts[:2] != ["v2", "models"] or len(parts) < 3:
            raise ProtocolError(404, f"no route {self.path!r}")
        name, rest, version = parts[2], parts[3:], None
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = rest[1], rest[2:]
        if name != model.name:
            raise ProtocolError(404, f"unknown model {name!r}: this server serves "
                                f"{model.name!r}")
        if version is not None and version != model.version:
            raise ProtocolError(404, f"version {version!r} of {name!r} is not served (serving "
                                f"{model.version!r})")
        if rest == []:
            self._method(method, "GET")
            return _json(200, self._metadata())
        if rest == ["ready"]:
            self._method(method, "GET")
            ready = model.version is not None
            return _json(200 if ready else 400, {"name": name, "ready": ready})
        if rest in (["infer"], ["record"]):
            self._method(method, "POST")
            return self._infer(body, record=rest == ["record"])
        raise ProtocolError(404, f"no route {self.path!r}")

    def _method(self, method: str, allowed: str) -> None:
        if method != allowed:
            raise ProtocolError(405, f"{self.path} takes {allowed}, not {method}")

    def _metadata(self) -> dict[str, Any]:
        model, engine = self.server.model, self.server.model.engine
        if engine is None:
            raise NoActiveModelError(f"no version of {model.name!r} serves yet")
        sig = ModelSignature.of(engine)  # what requests are checked against, declared
        return {"name": model.name, "versions": [model.version], "platform": engine.platform,
                "inputs": [t.metadata() for t in sig.inputs],
                "outputs": [t.metadata() for t in sig.outputs]}

    def _body(self) -> bytes:
        limits = self.server.limits
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise ProtocolError(411, "chunked bodies are not taken: send Content-Length")
        if (self.headers.get("Content-Encoding") or "identity") != "identity":
            raise ProtocolError(415, "compressed request bodies are not taken")
        text = self.headers.get("Content-Length")
        if text is None:
            raise ProtocolError(411, "Content-Length is required")
        if not text.strip().isdigit():
            raise ProtocolError(400, f"Content-Length {text!r} is not a byte count")
        n = int(text)
        if n > limits.max_body_bytes:
            raise ProtocolError(413, f"body of {n} bytes is over the server's limit of "
                                f"{limits.max_body_bytes}")
        deadline = time.monotonic() + limits.request_timeout_s
        chunks, left = [], n
        while left:
            if time.monotonic() > deadline:
                raise TimeoutError
            chunk = self.rfile.read1(min(left, 1 << 16))  # type: ignore[attr-defined]
            if not chunk:
                raise ProtocolError(400, f"the body ended {left} bytes short of Content-Length")
            chunks.append(chunk)
            left -= len(chunk)
        self._body_read = True
        return b"".join(chunks)

    def _infer(self, body: bytes, *, record: bool) -> Response:
        model = self.server.model
        engine = model.engine
        if engine is None:
            raise NoActiveModelError(f"no version of {model.name!r} serves yet")
        req = parse_infer(body, self.headers.get(HEADER_LENGTH), ModelSignature.of(engine))
        if record:
            label = req.parameters.get("label")
            if label is not None and (not isinstance(label, int) or isinstance(label, bool)):
                raise ProtocolError(400, f"parameters.label {label!r} is not an integer")
            stored = model.record(req.x, label=label)
            return _json(200, {"model_name": model.name, "model_version": model.version,
                               "stored": stored})
        logits, version = model.predict_versioned(req.x)
        body, headers = encode_infer({engine.output_name: logits}, req, model_name=model.name,
                                     model_version=version)
        return 200, body, headers


class _Server(ThreadingHTTPServer):
    """Threads per connection, at most ``limits.max_connections`` of them."""

    daemon_threads = True

    def __init__(self, address: Any, model: ActiveModel, limits: OipLimits) -> None:
        self.model, self.limits = model, limits
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._open_lock = threading.Lock()
        self.open_connections = 0
        super().__init__(address, _Handler)

    def _count(self, step: int) -> None:
        with self._open_lock:
            self.open_connections += step

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = json.dumps({"error": "server busy: every connection slot is taken, retry"},
                              allow_nan=False)
            with contextlib.suppress(OSError):  # the client may be gone already
                request.sendall(
                    f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
            self.shutdown_request(request)
            return
        self._count(+1)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            self._count(-1)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:  # the slot first: a count of 0 means every slot is free again
            self._slots.release()
            self._count(-1)


class _UnixServer(_Server):
    address_family = socket.AF_UNIX
    allow_reuse_address = False

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would split a (host, port)
        self.server_name, self.server_port = "localhost", 0


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket left by a dead server; refuse a live one or anything else."""
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


class OipServer:
    """The protocol over ``host:port`` (TCP) or ``unix_socket``; :meth:`start` serves from a
    thread, :meth:`serve_forever` from the caller's."""

    def __init__(self, model: ActiveModel, *, host: str = "127.0.0.1", port: int = 8000,
                 unix_socket: Path | None = None, limits: OipLimits | None = None) -> None:
        self.model, self.unix_socket = model, unix_socket
        limits = limits or OipLimits()
        if unix_socket is not None:
            _clear_stale_socket(Path(unix_socket))
            self._http: _Server = _UnixServer(str(unix_socket), model, limits)
            Path(unix_socket).chmod(0o660)  # the application's user and group, nobody else
        else:
            self._http = _Server((host, port), model, limits)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``http://host:port`` or ``unix:PATH``."""
        if self.unix_socket is not None:
            return f"unix:{self.unix_socket}"
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def open_connections(self) -> int:
        """Client connections holding a slot now (at most ``limits.max_connections``)."""
        return self._http.open_connections

    @property
    def port(self) -> int:
        return int(self._http.server_address[1]) if self.unix_socket is None else 0

    def serve_forever(self) -> None:
        self._http.serve_forever(poll_interval=0.2)

    def start(self) -> OipServer:
        self._thread = threading.Thread(target=self.serve_forever, name="oip-server",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and close the listening socket. Connections being served finish
        on their own threads. (Stop a :meth:`serve_forever` running in another thread with
        ``shutdown()`` first; a :meth:`start`-ed server is stopped here.)"""
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join()
            self._thread = None
        self._http.server_close()
        if self.unix_socket is not None:
            Path(self.unix_socket).unlink(missing_ok=True)

    def shutdown(self) -> None:
        """End :meth:`serve_forever` (call from another thread)."""
        self._http.shutdown()

    def __enter__(self) -> OipServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
