"""The HTTP(S) client under ``HttpStore``: one registry origin, a kept-alive connection per
thread (one TCP/TLS handshake per worker, not per chunk) with separate connect and read
timeouts, requests that follow redirects and one bearer challenge on a read, the token sent
only where :mod:`registry.credentials` allows, and every non-success answer turned into the
``StoreError`` that says why (not found, transient with its Retry-After, conflict, no token).
"""

from __future__ import annotations

import contextlib
import http.client
import ssl
import threading
from typing import Any
from urllib.parse import quote, urljoin, urlparse

from registry.credentials import REGISTRY_ENV, TOKEN_ENV, RegistryCredential, credential_from_env
from registry.errors import (
    RefError,
    SlowTransferError,
    StoreConflictError,
    StoreError,
    StoreNotFoundError,
    StoreTransientError,
)
from registry.stores.http_transport import (
    ReadTimeoutHTTPConnection,
    ReadTimeoutHTTPSConnection,
    Watchdog,
)
from registry.transfer import Deadline, TransferConfig

_MAX_REDIRECTS = 5


class HttpClient:
    """Connections, requests and error answers for one HTTP(S) registry; ``HttpStore`` adds
    the store's reads and writes on top."""

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
        conn: ReadTimeoutHTTPConnection | ReadTimeoutHTTPSConnection
        if scheme == "https":
            conn = ReadTimeoutHTTPSConnection(
                host, port, timeout=self.cfg.connect_timeout_s, context=ssl.create_default_context()
            )
        else:
            conn = ReadTimeoutHTTPConnection(host, port, timeout=self.cfg.connect_timeout_s)
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
    ) -> tuple[http.client.HTTPResponse, Any, str, Watchdog]:
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
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection, Watchdog]:
        path = target.path + (f"?{target.query}" if target.query else "")
        for fresh_retry in (False, True):
            if deadline is not None and deadline.expired():
                raise deadline.error()
            if pooled:
                conn, reused = self._pooled()
            else:
                conn, reused = self._connect(target.scheme, target.hostname, target.port), False
            watchdog = Watchdog(conn, deadline)
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
