"""Serve a registry folder over HTTP: ``python -m registry.serve DIR [--port P]``.

What a device pulls from and uploads to, for a lab, a demo or a single site: GET and HEAD
with single byte ranges (206 / 416) so interrupted pulls resume, and PUT for device uploads,
accepted only with ``Authorization: Bearer $EDGETRAIN_REGISTRY_TOKEN`` (the same variable the
client sends). Writes go through :class:`registry.stores.folder.LocalStore` (safe keys, atomic
rename); nothing is interpreted, so a tampered object is caught by the client's signature and
hash checks, not here. In production put the folder behind nginx, a CDN or S3 instead.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from registry.errors import RegistryError
from registry.stores.folder import LocalStore
from registry.stores.http import TOKEN_ENV

MAX_PUT_BYTES = 256 << 20
"""A chunk or manifest; larger bodies are refused (413) before they are read."""
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
log = logging.getLogger("registry.serve")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: LocalStore
    token: str | None

    def log_message(self, format: str, *args: object) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _key(self) -> str | None:
        key = unquote(urlparse(self.path).path).lstrip("/")
        try:
            self.store.path(key)
        except (RegistryError, ValueError):
            self._empty(400)
            return None
        return key

    def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._get(body=False)

    def do_GET(self) -> None:
        self._get(body=True)

    def _get(self, body: bool) -> None:
        key = self._key()
        if key is None:
            return
        path = self.store.path(key)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, IsADirectoryError):
            self._empty(404)
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            start, end, status = 0, size - 1, 200
            rng = self.headers.get("Range")
            if rng:
                m = _RANGE_RE.match(rng.strip())
                if not m or (not m[1] and not m[2]):
                    self._empty(416, {"Content-Range": f"bytes */{size}"})
                    return
                if m[1]:
                    start = int(m[1])
                    end = min(int(m[2]), size - 1) if m[2] else size - 1
                else:  # suffix range: the last N bytes
                    start = max(0, size - int(m[2]))
                if start >= size or start > end:
                    self._empty(416, {"Content-Range": f"bytes */{size}"})
                    return
                status = 206
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if body:
                f.seek(start)
                _copy(f, self.wfile, end - start + 1)

    def do_PUT(self) -> None:
        given = self.headers.get("Authorization", "")
        if not self.token or not hmac.compare_digest(given, f"Bearer {self.token}"):
            self._empty(401 if not given else 403)
            self.close_connection = True
            return
        key = self._key()
        if key is None:
            return
        length = int(self.headers.get("Content-Length") or -1)
        if length < 0 or length > MAX_PUT_BYTES:
            self._empty(413 if length > 0 else 411)
            self.close_connection = True
            return
        data = self.rfile.read(length)
        if len(data) != length:
            self.close_connection = True
            return
        self.store.put(key, data)
        self._empty(201)


def _copy(src: object, dst: object, n: int) -> None:
    left = n
    while left > 0:
        block = src.read(min(left, 256 << 10))  # type: ignore[attr-defined]
        if not block:
            return
        dst.write(block)  # type: ignore[attr-defined]
        left -= len(block)


def make_server(root: Path, host: str = "127.0.0.1", port: int = 0,
                token: str | None = None) -> ThreadingHTTPServer:
    """A server bound to (host, port); ``token`` enables PUT. Call ``serve_forever()``."""
    root.mkdir(parents=True, exist_ok=True)
    handler = type("Handler", (_Handler,), {"store": LocalStore(root), "token": token})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m registry.serve",
        description=__doc__.split("\n\n")[0],
        epilog=f"PUT needs ${TOKEN_ENV} set here and on the uploading device. "
        "The first line printed is the URL to give as --registry.",
    )
    ap.add_argument("root", type=Path, help="the registry folder (what hpc-train publish writes)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = a free port")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    httpd = make_server(args.root, args.host, args.port, os.environ.get(TOKEN_ENV))
    print(f"http://{args.host}:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
