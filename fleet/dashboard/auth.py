"""Who may press the dashboard's buttons: the operator token, sessions and every check a write
passes.

- The token is a file of the operator's (``--operator-token-file``), mode 0600 or stricter,
  read once at start; without it the dashboard is read-only and every write is refused.
- ``POST /login`` with the token (compared in constant time; failed logins are rate-limited)
  opens a session: a random id in an HttpOnly, SameSite=Strict cookie, its state held here in
  memory (bounded, expiring), never in the cookie.
- Every write must carry the session cookie, the session's CSRF token in the
  ``X-CSRF-Token`` header (a synchronizer token: random per session, given to the page in a
  meta tag, compared in constant time) and an ``Origin`` (or, without one, a ``Referer``)
  that is the dashboard's own; and every request a ``Host`` that is the dashboard's own, so a
  page of another site re-pointed at this address by DNS (rebinding) reads nothing.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

COOKIE = "edgetrain_dashboard"
CSRF_HEADER = "x-csrf-token"
SESSION_S = 8 * 3600.0
"""A session's life from login (a shift)."""
IDLE_S = 3600.0
"""A session unused this long ends."""
MAX_SESSIONS = 64
"""Sessions held at once; the least recently used one goes first."""
LOGIN_FAILURES = 10
LOGIN_WINDOW_S = 60.0
"""At most ``LOGIN_FAILURES`` failed logins in any ``LOGIN_WINDOW_S``: guessing is slow."""
MIN_TOKEN_CHARS = 16


class TokenFileError(ValueError):
    """The token file is missing, readable by others, or too short; the message says which."""


def read_token(path: Path) -> str:
    """The operator token in ``path``: one line, at least 16 characters, the file 0600 (or
    stricter) and owned by this user, as an ssh key is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise TokenFileError(f"--operator-token-file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"--operator-token-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise TokenFileError(
                f"--operator-token-file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets "
                f"others read it; chmod 600 {path}")
        if st.st_uid != os.getuid():
            raise TokenFileError(f"--operator-token-file {path}: owned by uid {st.st_uid}, "
                                 "not by the user running the dashboard")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    token = data.decode("utf-8", "replace").strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise TokenFileError(f"--operator-token-file {path}: the token must be one word of at "
                             f"least {MIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32 "
                             f"> {path}`)")
    return token


@dataclass
class Session:
    csrf: str
    created: float
    used: float


class Refused(Exception):
    """A request the checks refuse: answered 403 with this message."""


class Operators:
    """The operator token (None: read-only), the sessions, and the checks of a write."""

    def __init__(self, token: str | None, origins: set[str]) -> None:
        """``origins``: the dashboard's own origins (``http://host:port``), as a browser
        names them in ``Origin``."""
        self._token = token
        self.origins: set[str] = set()
        self.hosts: set[str] = set()
        self.allow(origins)
        self._sessions: dict[str, Session] = {}
        self._failures: deque[float] = deque()
        self._lock = threading.Lock()

    def allow(self, origins: set[str]) -> None:
        """The dashboard's own origins (and so the Host names it answers to)."""
        self.origins = set(origins)
        self.hosts = {urlsplit(o).netloc for o in origins}

    @property
    def writable(self) -> bool:
        return self._token is not None

    # --- what every request passes --------------------------------------------------

    def check_host(self, host: str | None) -> None:
        if host not in self.hosts:
            raise Refused(f"Host {host!r} is not this dashboard's address "
                          f"({', '.join(sorted(self.hosts))})")

    def check_origin(self, origin: str | None, referer: str | None) -> None:
        """The request comes from the dashboard's own page (a browser always sends Origin on
        a POST; Referer stands in where a privacy setting dropped it)."""
        if origin is not None and origin != "null":
            if origin not in self.origins:
                raise Refused(f"cross-origin request from {origin} refused: writes come "
                              "only from the dashboard's own page")
            return
        if referer:
            parts = urlsplit(referer)
            if f"{parts.scheme}://{parts.netloc}" in self.origins:
                return
            raise Refused("cross-origin request refused (Referer is another site's): writes "
                          "come only from the dashboard's own page")
        raise Refused("request without Origin or Referer refused: writes come only from "
                      "the dashboard's own page")

    # --- login and sessions ---------------------------------------------------------

    def login(self, token: str) -> tuple[str, Session]:
        """A new session for the right token; :class:`Refused` otherwise."""
        if self._token is None:
            raise Refused("read-only dashboard: it was started without "
                          "--operator-token-file, so nobody can log in")
        now = time.monotonic()
        with self._lock:
            while self._failures and now - self._failures[0] > LOGIN_WINDOW_S:
                self._failures.popleft()
            if len(self._failures) >= LOGIN_FAILURES:
                raise Refused(f"too many failed logins: wait {LOGIN_WINDOW_S:.0f} s")
            if not hmac.compare_digest(token.encode(), self._token.encode()):
                self._failures.append(now)
                raise Refused("wrong operator token")
            self._expire(now)
            while len(self._sessions) >= MAX_SESSIONS:
                oldest = min(self._sessions, key=lambda k: self._sessions[k].used)
                del self._sessions[oldest]
            sid = secrets.token_urlsafe(32)
            s = Session(secrets.token_urlsafe(32), now, now)
            self._sessions[sid] = s
            return sid, s

    def logout(self, sid: str | None) -> None:
        with self._lock:
            self._sessions.pop(sid or "", None)

    def session(self, sid: str | None) -> Session | None:
        """The live session of cookie ``sid`` (its use renews its idle time), or None."""
        if not sid:
            return None
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            s = self._sessions.get(sid)
            if s is not None:
                s.used = now
            return s

    def _expire(self, now: float) -> None:
        dead = [k for k, s in self._sessions.items()
                if now - s.created > SESSION_S or now - s.used > IDLE_S]
        for k in dead:
            del self._sessions[k]

    def check_write(self, sid: str | None, csrf: str | None, origin: str | None,
                    referer: str | None) -> Session:
        """Everything a write needs, in this order: a writable dashboard, the page's own
        origin, a live session, the session's CSRF token."""
        if self._token is None:
            raise Refused("read-only dashboard: start it with --operator-token-file to allow "
                          "approve, pause, resume and abort")
        self.check_origin(origin, referer)
        s = self.session(sid)
        if s is None:
            raise Refused("not logged in (or the session expired): log in with the operator "
                          "token first")
        if not csrf:
            raise Refused(f"missing CSRF token: send the page's csrf-token in the "
                          f"{CSRF_HEADER} header")
        if not hmac.compare_digest(csrf.encode(), s.csrf.encode()):
            raise Refused("wrong CSRF token for this session: reload the page")
        return s
