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
    GET  /metrics                        Prometheus text format: Triton's inference counters
                                         (:mod:`agent.runtime.serve_metrics`)

Errors are ``{"error": "..."}``: 400 a request the model cannot take (or a malformed HTTP
request), 404 an unknown model, version or route (or no spool, for record), 405 a wrong
method, 408 a request head or body not received in time, 411 no Content-Length, 413 a body
over the limit, 415 a compressed body, 503 no version serving yet (or every connection slot
busy). Ready answers 400 when not ready, as the protocol says ("a 4xx status indicates
false").

Every resource is bounded (:class:`OipLimits`): body bytes (Content-Length required, checked
before a byte of the body is read), connections held at once (one more is answered 503 at
accept and closed), the time a request's whole head may take from accept (a client dripping
its headers is cut at it, however steadily it drips), the time a whole body may take, idle
keep-alive, and the threads running the model. The server is :mod:`registry.http_server`
(uvicorn, h11): waiting connections are coroutines, not threads.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from agent.runtime.active_model import ActiveModel, NoSpoolError
from agent.runtime.oip_codec import HEADER_LENGTH, ProtocolError, encode_infer, parse_infer
from agent.runtime.oip_request import ModelSignature
from agent.runtime.serve_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from agent.runtime.serve_metrics import ServeMetrics
from registry.errors import NoActiveModelError
from registry.http_request import (
    BodyRefused,
    ClientGone,
    WorkerThreads,
    as_written,
    read_body,
    request_length,
)
from registry.http_server import HttpLimits, HttpServer

log = logging.getLogger("agent.runtime.oip")

Answer = tuple[int, bytes, dict[str, str]]


class OipLimits(BaseModel):
    """What one request and the server as a whole may take."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=16 << 20, ge=1024)
    """Largest request body (bytes); a larger Content-Length is answered 413 unread."""
    max_connections: int = Field(default=512, ge=1)
    """Client connections held at once (idle ones cost a coroutine, not a thread); one more is
    answered 503 at accept and closed."""
    request_timeout_s: float = Field(default=10.0, gt=0)
    """Longest wait for a whole request body; also the header and keep-alive deadlines unless
    they are given."""
    header_timeout_s: float | None = Field(default=None, gt=0)
    """A request's line and headers must all arrive within this, counted from accept (or from
    the previous response on a kept-alive connection); None: request_timeout_s."""
    keep_alive_s: float | None = Field(default=None, gt=0)
    """An idle kept-alive connection is closed after this (at most the header deadline);
    None: request_timeout_s."""
    infer_threads: int = Field(default=4, ge=1, le=256)
    """Requests run through the model at once (each on a thread); more wait their turn."""

    def http(self) -> HttpLimits:
        """The server's bounds (:mod:`registry.http_server`)."""
        head = self.header_timeout_s or self.request_timeout_s
        return HttpLimits(header_timeout_s=head,
                          keep_alive_s=min(self.keep_alive_s or self.request_timeout_s, head),
                          write_timeout_s=self.request_timeout_s,
                          max_connections=self.max_connections)


def _version() -> str:
    try:
        return importlib.metadata.version("edgetrain")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def _json(status: int, doc: dict[str, Any]) -> Answer:
    return status, json.dumps(doc, allow_nan=False).encode(), {"Content-Type": "application/json"}


class _BodyLate(Exception):
    """The request body did not arrive within its deadline (408, and close)."""


class OipApp:
    """The protocol as an ASGI application over ``model``; the model runs on at most
    ``limits.infer_threads`` threads, the rest of a request on the event loop."""

    def __init__(self, model: ActiveModel, limits: OipLimits,
                 metrics: ServeMetrics | None = None) -> None:
        self.model, self.limits = model, limits
        self.metrics = metrics or ServeMetrics(model.name)
        self.threads = WorkerThreads(limits.infer_threads)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        status, body, headers, close = await self._dispatch(request)
        if close:  # an unread body would be parsed as the next request
            headers["Connection"] = "close"
        await as_written(Response(body, status, headers), headers)(scope, receive, send)

    async def _dispatch(self, request: Request) -> tuple[int, bytes, dict[str, str], bool]:
        method, path = request.method, _target(request)
        body_read = method != "POST"
        try:
            if method not in ("GET", "POST"):
                raise ProtocolError(501, f"method {method[:20]!r} is not served: GET or POST")
            # The body first, whatever the route: an error answered with the body unread
            # must close the connection (the rest would parse as the next request).
            body = await self._body(request) if method == "POST" else b""
            body_read = True
            parts = [unquote(p) for p in path.strip("/").split("/")]
            status, out, headers = await self._route(request, method, parts, body)
        except ProtocolError as e:
            status, out, headers = _json(e.status, {"error": str(e)})
        except NoActiveModelError as e:
            status, out, headers = _json(503, {"error": str(e)})
        except NoSpoolError as e:
            status, out, headers = _json(404, {"error": str(e)})
        except ValueError as e:  # what ActiveModel.predict refuses (shape, dtype)
            status, out, headers = _json(400, {"error": str(e)})
        except _BodyLate:
            status, out, headers = _json(408, {"error": "request not received in time"})
        except Exception as e:  # one bad request never takes the server down
            log.exception("%s %s failed", method, path[:200])
            status, out, headers = _json(500, {"error": f"internal error: {e}"})
        return status, out, headers, not body_read

    async def _body(self, request: Request) -> bytes:
        headers = request.headers
        if "chunked" in (headers.get("Transfer-Encoding") or "").lower():
            raise ProtocolError(411, "chunked bodies are not taken: send Content-Length")
        if (headers.get("Content-Encoding") or "identity") != "identity":
            raise ProtocolError(415, "compressed request bodies are not taken")
        try:
            n = request_length(headers, self.limits.max_body_bytes)
            return await read_body(request.receive, n, timeout_s=self.limits.request_timeout_s)
        except BodyRefused as e:
            raise ProtocolError(e.status, str(e)) from None
        except TimeoutError:
            raise _BodyLate from None
        except ClientGone as e:  # nobody to answer; said for the log
            raise ProtocolError(400, str(e)) from None

    async def _route(self, request: Request, method: str, parts: list[str],
                     body: bytes) -> Answer:
        model, path = self.model, _target(request)
        if parts[:2] == ["v2", "health"] and len(parts) == 3 and parts[2] in ("live", "ready"):
            _method(path, method, "GET")
            if parts[2] == "live":
                return _json(200, {"live": True})
            ready = model.version is not None
            return _json(200 if ready else 400, {"ready": ready})
        if parts == ["metrics"]:  # Prometheus (agent.runtime.serve_metrics: Triton's names)
            _method(path, method, "GET")
            return 200, self.metrics.exposition(), {"Content-Type": METRICS_CONTENT_TYPE}
        if parts == ["v2"]:
            _method(path, method, "GET")
            return _json(200, {"name": "edgetrain", "version": _version(),
                               "extensions": ["binary_tensor_data"]})
        if parts[:2] != ["v2", "models"] or len(parts) < 3:
            raise ProtocolError(404, f"no route {path!r}")
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
            _method(path, method, "GET")
            return _json(200, self._metadata())
        if rest == ["ready"]:
            _method(path, method, "GET")
            ready = model.version is not None
            return _json(200 if ready else 400, {"name": name, "ready": ready})
        if rest in (["infer"], ["record"]):
            _method(path, method, "POST")
            # Parsing, the model and encoding are CPU work: on a thread, the loop serving on.
            return await self.threads.run(self._infer, body, request.headers.get(HEADER_LENGTH),
                                          rest == ["record"])
        raise ProtocolError(404, f"no route {path!r}")

    def _metadata(self) -> dict[str, Any]:
        model, engine = self.model, self.model.engine
        if engine is None:
            raise NoActiveModelError(f"no version of {model.name!r} serves yet")
        sig = ModelSignature.of(engine)  # what requests are checked against, declared
        return {"name": model.name, "versions": [model.version], "platform": engine.platform,
                "inputs": [t.metadata() for t in sig.inputs],
                "outputs": [t.metadata() for t in sig.outputs]}

    def _infer(self, body: bytes, header_length: str | None, record: bool) -> Answer:
        model = self.model
        if record:
            return self._record(body, header_length)
        with self.metrics.request(model.version) as inference:
            engine = model.engine
            if engine is None:
                raise NoActiveModelError(f"no version of {model.name!r} serves yet")
            req = parse_infer(body, header_length, ModelSignature.of(engine))
            outputs, version = inference.infer(model, req.x)
            out, headers = encode_infer(outputs, req, model_name=model.name,
                                        model_version=version)
        return 200, out, headers

    def _record(self, body: bytes, header_length: str | None) -> Answer:
        model = self.model
        engine = model.engine
        if engine is None:
            raise NoActiveModelError(f"no version of {model.name!r} serves yet")
        req = parse_infer(body, header_length, ModelSignature.of(engine))
        label = req.parameters.get("label")
        if label is not None and (not isinstance(label, int) or isinstance(label, bool)):
            raise ProtocolError(400, f"parameters.label {label!r} is not an integer")
        stored = model.record(req.x, label=label)
        return _json(200, {"model_name": model.name, "model_version": model.version,
                           "stored": stored})


def _method(path: str, method: str, allowed: str) -> None:
    if method != allowed:
        raise ProtocolError(405, f"{path} takes {allowed}, not {method}")


def _target(request: Request) -> str:
    """The request target as sent, undecoded (before any '?')."""
    return request.scope.get("raw_path", b"").decode("latin-1")


class OipServer:
    """The protocol over ``host:port`` (TCP) or ``unix_socket`` (mode 0660); :meth:`start`
    serves from a thread, :meth:`serve_forever` from the caller's."""

    def __init__(self, model: ActiveModel, *, host: str = "127.0.0.1", port: int = 8000,
                 unix_socket: Path | None = None, limits: OipLimits | None = None,
                 metrics: ServeMetrics | None = None) -> None:
        self.model, self.unix_socket = model, unix_socket
        self.limits = limits or OipLimits()
        self.metrics = metrics or ServeMetrics(model.name)
        """What it answered, at GET /metrics; share it with the gRPC server's."""
        self._http = HttpServer(OipApp(model, self.limits, self.metrics),
                                limits=self.limits.http(),
                                host=host, port=port, uds=unix_socket, name="edgetrain-oip")

    @property
    def address(self) -> str:
        """``http://host:port`` or ``unix:PATH``."""
        return self._http.address

    @property
    def open_connections(self) -> int:
        """Client connections holding a slot now (at most ``limits.max_connections``)."""
        return self._http.open_connections

    @property
    def port(self) -> int:
        return self._http.port

    def serve_forever(self) -> None:
        """Serve from this thread until SIGTERM or SIGINT (in the main thread) or
        :meth:`shutdown`."""
        self._http.serve_forever()

    def start(self) -> OipServer:
        self._http.start()
        return self

    def close(self) -> None:
        """Stop accepting and close the listening socket (removing a Unix socket's file); the
        requests in flight finish first, for a few seconds at most."""
        self._http.close()

    def shutdown(self) -> None:
        """End :meth:`serve_forever` (call from another thread)."""
        self._http.shutdown()

    def __enter__(self) -> OipServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
