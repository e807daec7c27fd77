"""The former ``agentctl serve`` server, kept only as the baseline of benchmarks/http_server.py:
the standard library's ``ThreadingHTTPServer``, a thread per connection up to
``max_connections`` (one more: 503 and close), ``request_timeout_s`` on each read from a
client and on a whole body. Trimmed to what the benchmark asks of it (health, ready, infer);
the request path is the one the server had (same codec, same model call).

Its weakness, which the benchmark measures: a client sending its headers one byte a second
never waits ``request_timeout_s`` on a read, so it keeps its thread (and slot) for as long as
it drips.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from agent.runtime.active_model import ActiveModel
from agent.runtime.oip_codec import HEADER_LENGTH, ProtocolError, encode_infer, parse_infer
from agent.runtime.oip_request import ModelSignature
from registry.errors import NoActiveModelError

Answer = tuple[int, bytes, dict[str, str]]


def _json(status: int, doc: dict[str, Any]) -> Answer:
    return status, json.dumps(doc).encode(), {"Content-Type": "application/json"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadedOipServer
    wbufsize = -1

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _dispatch(self, method: str) -> None:
        self._body_read = method != "POST"
        try:
            request = self._body() if method == "POST" else b""
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            status, body, headers = self._route(method, parts, request)
        except ProtocolError as e:
            status, body, headers = _json(e.status, {"error": str(e)})
        except NoActiveModelError as e:
            status, body, headers = _json(503, {"error": str(e)})
        except ValueError as e:
            status, body, headers = _json(400, {"error": str(e)})
        except TimeoutError:
            self.close_connection = True
            status, body, headers = _json(408, {"error": "request not received in time"})
        if not self._body_read:
            self.close_connection = True
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _route(self, method: str, parts: list[str], body: bytes) -> Answer:
        model = self.server.model
        if parts == ["v2", "health", "live"]:
            return _json(200, {"live": True})
        if parts == ["v2", "health", "ready"]:
            ready = model.version is not None
            return _json(200 if ready else 400, {"ready": ready})
        if parts == ["v2", "models", model.name, "infer"] and method == "POST":
            engine = model.engine
            if engine is None:
                raise NoActiveModelError(f"no version of {model.name!r} serves yet")
            req = parse_infer(body, self.headers.get(HEADER_LENGTH), ModelSignature.of(engine))
            outputs, version = model.infer_versioned(req.x)
            out, headers = encode_infer(outputs, req, model_name=model.name,
                                        model_version=version)
            return 200, out, headers
        raise ProtocolError(404, f"no route {self.path!r}")

    def _body(self) -> bytes:
        text = self.headers.get("Content-Length")
        if text is None:
            raise ProtocolError(411, "Content-Length is required")
        if not text.strip().isdigit():
            raise ProtocolError(400, f"Content-Length {text!r} is not a byte count")
        n = int(text)
        if n > self.server.max_body_bytes:
            raise ProtocolError(413, "body over the server's limit")
        deadline = time.monotonic() + self.server.request_timeout_s
        chunks, left = [], n
        while left:
            if time.monotonic() > deadline:
                raise TimeoutError
            chunk = self.rfile.read1(min(left, 1 << 16))  # type: ignore[attr-defined]
            if not chunk:
                raise ProtocolError(400, "the body ended short of Content-Length")
            chunks.append(chunk)
            left -= len(chunk)
        self._body_read = True
        return b"".join(chunks)


class ThreadedOipServer(ThreadingHTTPServer):
    """Threads per connection, at most ``max_connections`` of them."""

    daemon_threads = True
    # The server had socketserver's listen queue of 5, which drops a burst of connections (the
    # kernel completes them over seconds of retransmits); 128 here, so the benchmark measures
    # threads against coroutines, not that queue.
    request_queue_size = 128

    def __init__(self, model: ActiveModel, port: int = 0, *, max_connections: int = 32,
                 request_timeout_s: float = 10.0, max_body_bytes: int = 16 << 20) -> None:
        self.model = model
        self.request_timeout_s, self.max_body_bytes = request_timeout_s, max_body_bytes
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(("127.0.0.1", port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = json.dumps({"error": "server busy: every connection slot is taken, retry"})
            with contextlib.suppress(OSError):
                request.sendall(
                    f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
