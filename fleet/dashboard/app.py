"""The dashboard's web application (Starlette, ASGI): its routes, the checks each request
passes, and the responses' security headers.

- ``GET /``: the page (a Jinja2 template carrying the first snapshot, so it paints without
  waiting for the stream), ``GET /static/dashboard.js`` its script;
- ``GET /api/snapshot`` the same snapshot as JSON, ``GET /events`` the live stream
  (``fleet.dashboard.live``); both take the table's view (``group``, ``q``, ``state``,
  ``page``);
- ``POST /login``, ``POST /logout``, ``POST /rollouts/{id}/{approve|pause|resume|abort}``: the
  writes, each checked by ``fleet.dashboard.auth`` and answered 403 with the reason when a
  check fails; a rollout request goes through ``fleet.rollout.operator``, the path of
  ``fleetctl rollout pause|resume|abort|approve``.

Bodies are bounded (:data:`MAX_BODY` bytes, read within :data:`BODY_TIMEOUT_S`) and writes
rate-limited per session (:data:`WRITES_PER_MINUTE`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.dashboard.auth import COOKIE, CSRF_HEADER, SESSION_S, Operators, Refused
from fleet.dashboard.devices import View, ViewError
from fleet.dashboard.live import PING_S, Busy, Hub
from fleet.dashboard.snapshot import compact
from fleet.rollout import operator
from fleet.rollout.store import FleetStore
from registry.http_request import (
    BodyRefused,
    ClientGone,
    WorkerThreads,
    read_body,
    request_length,
)

HERE = Path(__file__).resolve().parent
MAX_BODY = 4096
BODY_TIMEOUT_S = 5.0
WRITES_PER_MINUTE = 60
BUTTONS = ("approve", "pause", "resume", "abort")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CSP, "x-content-type-options": "nosniff",
    "x-frame-options": "DENY", "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _script_safe(text: str) -> str:
    """JSON inside a <script> element: no ``</script>`` or ``<!--`` can end it early (device
    error messages are in it)."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


class _Guard:
    """Every request: a Host that is the dashboard's own (else 403), and the security headers
    on every response."""

    def __init__(self, app: ASGIApp, operators: Operators) -> None:
        self.app, self.operators = app, operators

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        try:
            self.operators.check_host(host)
        except Refused as e:
            await _error(403, str(e))(scope, receive, send)
            return
        extra = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message = {**message, "headers": [*message.get("headers", []),
                                                  *[h for h in extra if h[0] not in names]]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class Dashboard:
    """The application over ``hub`` (what it shows), ``operators`` (who may write) and the
    state db ``db`` (where a write's request is posted)."""

    def __init__(self, hub: Hub, operators: Operators, db: str | Path) -> None:
        self.hub, self.operators, self.db = hub, operators, db
        self._store: FleetStore | None = None
        self._store_lock = threading.Lock()
        self._writes: dict[str, deque[float]] = {}
        self._threads = WorkerThreads(2)
        env = Environment(loader=FileSystemLoader(HERE / "templates"),
                          autoescape=select_autoescape(["html"]))
        self._page = env.get_template("dashboard.html")
        self._js = (HERE / "static" / "dashboard.js").read_bytes()
        self._css = (HERE / "static" / "dashboard.css").read_bytes()
        routes = [
            Route("/", self.index), Route("/static/dashboard.js", self.script),
            Route("/static/dashboard.css", self.style),
            Route("/favicon.ico", lambda request: Response(status_code=204)),
            Route("/api/snapshot", self.snapshot), Route("/events", self.events),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/rollouts/{rid}/{verb}", self.rollout_request, methods=["POST"]),
        ]
        self.app = _Guard(Starlette(routes=routes), operators)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    # --- reads ------------------------------------------------------------------------

    def _view(self, request: Request) -> View:
        return View.parse(dict(request.query_params))

    async def index(self, request: Request) -> Response:
        try:
            v = self._view(request)
        except ViewError as e:
            return _error(400, str(e))
        s = self.operators.session(request.cookies.get(COOKIE))
        html = self._page.render(
            initial=_script_safe(compact(self.hub.page(v))), csrf=s.csrf if s else "",
            logged_in=s is not None, writable=self.operators.writable, live=PING_S)
        return HTMLResponse(html)

    async def script(self, request: Request) -> Response:
        return Response(self._js, media_type="text/javascript; charset=utf-8")

    async def style(self, request: Request) -> Response:
        return Response(self._css, media_type="text/css; charset=utf-8")

    async def snapshot(self, request: Request) -> Response:
        try:
            v = self._view(request)
        except ViewError as e:
            return _error(400, str(e))
        return Response(compact(self.hub.page(v)), media_type="application/json")

    async def events(self, request: Request) -> Response:
        try:
            v = self._view(request)
            self.hub.subscribe()
        except ViewError as e:
            return _error(400, str(e))
        except Busy as e:
            return JSONResponse({"error": str(e)}, status_code=503, headers={"retry-after": "5"})
        return EventSourceResponse(self.hub.events(v), ping=PING_S, send_timeout=10.0,
                                   headers={"x-accel-buffering": "no"})

    # --- writes -----------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        n = request_length(request.headers, MAX_BODY)
        raw = await read_body(request.receive, n, timeout_s=BODY_TIMEOUT_S)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            raise BodyRefused(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise BodyRefused(400, "the body must be a JSON object")
        return body

    async def login(self, request: Request) -> Response:
        try:
            self.operators.check_origin(request.headers.get("origin"),
                                        request.headers.get("referer"))
            body = await self._body(request)
            token = body.get("token")
            if not isinstance(token, str) or not token:
                return _error(400, "token: the operator token (a string) is required")
            sid, s = self.operators.login(token)
        except Refused as e:
            return _error(403, str(e))
        except BodyRefused as e:
            return _error(e.status, str(e))
        except (TimeoutError, ClientGone) as e:
            return _error(400, str(e))
        r = JSONResponse({"ok": True, "csrf": s.csrf})
        r.set_cookie(COOKIE, sid, max_age=int(SESSION_S), httponly=True, samesite="strict",
                     path="/")
        return r

    def _refused_write(self, request: Request) -> Response | None:
        """403 unless the request carries a live session, its CSRF token and this
        dashboard's own origin (``auth.Operators.check_write``); None: it may write."""
        try:
            self.operators.check_write(request.cookies.get(COOKIE),
                                       request.headers.get(CSRF_HEADER),
                                       request.headers.get("origin"),
                                       request.headers.get("referer"))
        except Refused as e:
            return _error(403, str(e))
        return None

    async def logout(self, request: Request) -> Response:
        refused = self._refused_write(request)
        if refused is not None:
            return refused
        self.operators.logout(request.cookies.get(COOKIE))
        r = JSONResponse({"ok": True})
        r.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return r

    def _rate_ok(self, sid: str) -> bool:
        now = time.monotonic()
        q = self._writes.setdefault(sid, deque())
        while q and now - q[0] > 60:
            q.popleft()
        if len(q) >= WRITES_PER_MINUTE:
            return False
        q.append(now)
        if len(self._writes) > 256:  # sessions long gone
            for k in [k for k, v in self._writes.items() if not v]:
                del self._writes[k]
        return True

    async def rollout_request(self, request: Request) -> Response:
        sid = request.cookies.get(COOKIE)
        refused = self._refused_write(request)
        if refused is not None:
            return refused
        try:
            body = await self._body(request)
        except BodyRefused as e:
            return _error(e.status, str(e))
        except (TimeoutError, ClientGone) as e:
            return _error(400, str(e))
        verb, rid = request.path_params["verb"], request.path_params["rid"]
        if verb not in BUTTONS:
            return _error(404, f"{verb!r}: the dashboard's requests are {', '.join(BUTTONS)}")
        wave = body.get("wave")
        if wave is not None and (verb != "approve" or not isinstance(wave, int)
                                 or isinstance(wave, bool)):
            return _error(400, "wave: a whole number, with approve only")
        assert sid is not None
        if not self._rate_ok(sid):
            return _error(429, f"over {WRITES_PER_MINUTE} requests a minute from this session")
        try:
            out = await self._threads.run(self._post, rid, verb, wave)
        except operator.UnknownRollout as e:
            return _error(404, str(e))
        except operator.Refused as e:
            return _error(409, str(e))
        self.hub.poke()
        return JSONResponse(out)

    def _post(self, rid: str, verb: str, wave: int | None) -> dict[str, Any]:
        with self._store_lock:
            if self._store is None:
                self._store = FleetStore(self.db)
            return operator.request(self._store, rid, verb, wave)
