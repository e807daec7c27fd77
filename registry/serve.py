"""Serve a registry folder over HTTP: ``python -m registry.serve DIR [--principals FILE
--trusted-keys DIR]``.

What devices pull from and upload to, for a lab, a demo or a single site: GET and HEAD of the
registry's layout (single byte ranges, 206 / 416, so interrupted pulls resume) and, when
started with a principals file, PUT from upstream publishers and devices, each with its own
bearer token. Every write is authorized per object (:mod:`registry.write_rules`): nothing is
overwritten, a chunk must hash to its key, a manifest must be signed by a key its uploader
owns and a device writes only its own versions. Every connection, request and body has a
bound (:mod:`registry.bounded_http`). In production put it behind a TLS proxy, or use S3 with
the bucket policy the docs describe (Explanation, "The model registry": "The same on S3").
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from registry.atomic import private_umask
from registry.bounded_http import BoundedHandler, BoundedHTTPServer, ServerLimits
from registry.credentials import is_loopback
from registry.errors import KeyFileError
from registry.principals import AuthoritySource, Principal, add_principal
from registry.write_rules import ObjectKey, Refused, RegistryFolder, parse_key

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_LENGTH_RE = re.compile(r"^[0-9]{1,15}$")
_DRAIN_MAX = 8 << 20
"""A refused upload's body up to this size is read and dropped, so the client (which sends the
whole body before it reads the answer) sees the refusal rather than a reset connection."""
_BLOCK = 256 << 10
log = logging.getLogger("registry.serve")


class _BadPath(Exception):
    """A request path that names nothing a registry could hold (400)."""


class _Handler(BoundedHandler):
    folder: RegistryFolder
    authority: AuthoritySource | None
    private_reads: bool

    def log_message(self, format: str, *args: object) -> None:
        log.info("%s %s", self.address_string(), format % args)

    # -- answers

    def _answer(self, status: int, message: str = "", headers: dict[str, str] | None = None,
                close: bool = False) -> None:
        body = (message + "\n").encode() if message else b""
        if status >= 400 and message:
            log.warning("%s %s %s: %d %s", self.address_string(), self.command, self.path[:200],
                        status, message)
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body:
            self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _refuse_unread(self, status: int, message: str, length: int | None,
                       headers: dict[str, str] | None = None) -> None:
        """Refuse a PUT whose body is still on the wire: drop a small body so the connection
        stays usable and the client reads the answer; close after a large or unknown one."""
        drained = length is not None and length <= _DRAIN_MAX and self._discard(length)
        self._answer(status, message, headers, close=not drained)

    def _discard(self, length: int) -> bool:
        self._arm_body(length)
        left = length
        try:
            while left:
                block = self.rfile.read(min(left, _BLOCK))
                if not block:
                    return False
                left -= len(block)
        except OSError:
            return False
        return True

    def _arm_body(self, length: int) -> None:
        lim = self.limits
        self.rfile.arm(lim.io_timeout_s + length / lim.min_upload_bytes_per_s, lim.io_timeout_s)

    # -- who and what

    def _object_key(self) -> ObjectKey | None:
        """The registry object the path names; None: a well-formed path outside the layout.
        Raises _BadPath for a malformed one."""
        raw = self.path
        try:
            key = unquote(urlparse(raw).path, errors="strict")[1:] if raw.startswith("/") else ""
        except UnicodeDecodeError:
            key = ""
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts) or any(
            ord(c) < 33 or c in "\\\x7f" for c in key
        ):
            raise _BadPath(f"malformed path {raw[:100]!r}")
        return parse_key(key)

    def _principal(self) -> Principal | None:
        if self.authority is None:
            return None
        return self.authority.current().authenticate(self.headers.get("Authorization"))

    def _challenge(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="edgetrain-registry"'}

    # -- reads

    def do_HEAD(self) -> None:
        self._get(body=False)

    def do_GET(self) -> None:
        self._get(body=True)

    def _get(self, body: bool) -> None:
        if self.private_reads and self._principal() is None:
            self._answer(401, "this registry needs a principal's token to read",
                         self._challenge())
            return
        try:
            ok = self._object_key()
        except _BadPath as e:
            self._answer(400, str(e))
            return
        if ok is None:
            self._answer(404)
            return
        try:
            f = open(self.folder.path(ok), "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self._answer(404)
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            span = self._range(size)
            if span is None:
                return
            start, end, status = span
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

    def _range(self, size: int) -> tuple[int, int, int] | None:
        """(first byte, last byte, status) of the answer; None when 416 was sent."""
        rng = self.headers.get("Range")
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
            self._answer(416, headers={"Content-Range": f"bytes */{size}"})
            return None
        return start, end, 206

    # -- writes

    def do_PUT(self) -> None:
        text = self.headers.get("Content-Length")
        length = int(text) if text is not None and _LENGTH_RE.match(text) else None
        if self.authority is None:
            self._refuse_unread(403, "this registry is read-only (started without "
                                     "--principals)", length)
            return
        who = self._principal()
        if who is None:
            self._refuse_unread(401, "unknown or missing token: send 'Authorization: Bearer "
                                     "TOKEN' with a principal's own token", length,
                                self._challenge())
            return
        try:
            ok = self._object_key()
        except _BadPath as e:
            self._answer(400, str(e), close=True)
            return
        if ok is None:
            self._refuse_unread(403, f"{who.name}: not a registry object; only chunks, "
                                     "manifests, signatures and counters are stored", length)
            return
        if self.headers.get("Transfer-Encoding") or text is None:
            self._answer(411, "send the body with a Content-Length", close=True)
            return
        if length is None:
            self._answer(400, f"Content-Length {text[:32]!r} is not a number", close=True)
            return
        limit = ok.max_bytes or self.limits.max_chunk_bytes
        if length > limit:
            self._answer(413, f"{ok.key}: {length} bytes, over the {limit}-byte limit",
                         close=True)
            return
        if self.folder.free_bytes() - length < self.limits.min_free_bytes:
            self._answer(507, "the registry's disk is full", close=True)
            return
        self._receive(who, ok, length)

    def _receive(self, who: Principal, ok: ObjectKey, length: int) -> None:
        """Stream the body to a temporary file, hashing it, then hand it to the rules."""
        tmp = self.folder.incoming()
        try:  # the temporary file is gone before the client hears anything
            answer = self._store(who, ok, length, tmp)
        finally:
            tmp.unlink(missing_ok=True)
        if answer is None:  # the client went away: nothing to answer
            self.close_connection = True
            return
        status, message, close = answer
        self._answer(status, message, close=close)

    def _store(self, who: Principal, ok: ObjectKey, length: int,
               tmp: Path) -> tuple[int, str, bool] | None:
        """(status, message, close the connection) for the upload, None if it was cut."""
        try:
            digest = self._body_to(tmp, length)
            if digest is None:
                return None
            assert self.authority is not None
            status = self.folder.accept(who, self.authority.current(), ok, tmp, digest)
            log.info("%s: %s stored (%d)", who.name, ok.key, status)
            return status, "", False
        except TimeoutError:
            return 408, f"{ok.key}: the body did not arrive in time", True
        except Refused as e:
            return e.status, f"{who.name}: {e}", False
        except OSError:  # the registry's own disk, not the client: say so, keep serving
            log.exception("%s: storing %s failed", who.name, ok.key)
            return 500, f"{ok.key}: the registry could not store it", True

    def _body_to(self, tmp: Path, length: int) -> str | None:
        """Stream ``length`` body bytes into ``tmp``; their sha256, or None if the client
        closed first. TimeoutError past the body's deadline."""
        digest = hashlib.sha256()
        self._arm_body(length)
        with open(tmp, "xb") as out:
            left = length
            while left:
                try:
                    block = self.rfile.read(min(left, _BLOCK))
                except TimeoutError:
                    raise
                except OSError:
                    return None
                if not block:
                    return None
                digest.update(block)
                out.write(block)
                left -= len(block)
        return digest.hexdigest()


def _copy(src: object, dst: object, n: int) -> None:
    left = n
    while left > 0:
        block = src.read(min(left, _BLOCK))  # type: ignore[attr-defined]
        if not block:
            return
        dst.write(block)  # type: ignore[attr-defined]
        left -= len(block)


def make_server(root: Path, host: str = "127.0.0.1", port: int = 0, *,
                authority: AuthoritySource | None = None, private_reads: bool = False,
                limits: ServerLimits | None = None) -> BoundedHTTPServer:
    """A server bound to (host, port); uploads need ``authority``. Call ``serve_forever()``."""
    if private_reads and authority is None:
        raise KeyFileError("private reads need principals: give --principals")
    root.mkdir(parents=True, exist_ok=True)
    limits = limits or ServerLimits()
    handler = type("Handler", (_Handler,), {
        "folder": RegistryFolder(root), "authority": authority, "private_reads": private_reads,
        "limits": limits,
    })
    return BoundedHTTPServer((host, port), handler, limits)


# -- command line ----------------------------------------------------------------------------

SERVE_EPILOG = """\
Uploads: each upstream publisher and each device has its own bearer token; the principals
file keeps only each token's sha256, the keys each principal signs with and, for a device,
its id. Mint one with

  python -m registry.serve add-principal --principals FILE --name jetson-07 --kind device \\
      --device-id jetson-07 --key jetson-07 --token-out jetson-07.token

and put jetson-07.pub.pem (and jetson-07.scope) in --trusted-keys. The principal sends its
token as $EDGETRAIN_REGISTRY_TOKEN with $EDGETRAIN_REGISTRY set to this server's URL (the
daemon: registry.token_file); clients send it to no other registry, and over plain http
only to loopback. A device may write only NAME@*+DEVICE_ID.* versions, upstream any other
version its keys' scopes cover; chunks must hash to their key; nothing is ever overwritten
(409). Both files are re-read when they change.

Without --principals the registry is read-only. The first line printed is the URL."""


def _serve_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m registry.serve", description=__doc__.split("\n\n")[0],
        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("root", type=Path, help="the registry folder (what hpc-train publish writes)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = a free port")
    ap.add_argument("--principals", type=Path, metavar="FILE",
                    help="who may upload: YAML/JSON of name, kind, device_id, keys, token_sha256")
    ap.add_argument("--trusted-keys", type=Path, metavar="DIR",
                    help="*.pub.pem (+ NAME.scope) of every key a principal signs with")
    ap.add_argument("--private-reads", action="store_true",
                    help="GET and HEAD need a principal's token too (default: anyone may read; "
                    "every object is signed or content-addressed)")
    defaults = ServerLimits()
    for name, field in ServerLimits.model_fields.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(getattr(defaults, name)),
                        default=getattr(defaults, name), metavar="N",
                        help=f"{field.description} (default: %(default)s)")
    return ap


def _principal_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m registry.serve add-principal",
        description="Mint a bearer token for a new upstream publisher or device: the token is "
        "written to --token-out (0600, never overwritten), its sha256 appended to --principals.",
    )
    ap.add_argument("--principals", type=Path, required=True, metavar="FILE")
    ap.add_argument("--name", required=True, help="the principal (a device: its id)")
    ap.add_argument("--kind", choices=["upstream", "device"], required=True)
    ap.add_argument("--device-id", help="the device's id (default: --name, kind device only)")
    ap.add_argument("--key", action="append", default=[], metavar="NAME",
                    help="a trusted key it signs with, NAME.pub.pem (repeatable; default: --name)")
    ap.add_argument("--token-out", type=Path, required=True, metavar="FILE",
                    help="where the token goes, for the principal's configuration")
    return ap


def build_parser() -> argparse.ArgumentParser:
    """The server's parser; ``add-principal`` has its own (:func:`subcommand_parsers`)."""
    return _serve_parser()


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Commands :func:`main` dispatches before the server's parser, by name (for the docs)."""
    return {"add-principal": _principal_parser()}


def _add_principal(argv: list[str]) -> int:
    args = _principal_parser().parse_args(argv)
    device_id = args.device_id or (args.name if args.kind == "device" else None)
    try:
        p = add_principal(args.principals, name=args.name, kind=args.kind,
                          keys=args.key or [args.name], token_out=args.token_out,
                          device_id=device_id)
    except KeyFileError as e:
        print(f"registry.serve add-principal: {e}", file=sys.stderr)
        return 2
    may = (f"its own versions NAME@*+{p.device_id}.*" if p.kind == "device"
           else "any version its keys' scopes cover")
    print(f"added {p.kind} {p.name} (keys {', '.join(p.keys)}): may write chunks and {may}; "
          f"token in {args.token_out}")
    return 0


@private_umask()
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["add-principal"]:
        return _add_principal(argv[1:])
    ap = _serve_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if (args.principals is None) != (args.trusted_keys is None):
        ap.error("--principals and --trusted-keys go together: uploads are checked against "
                 "the keys each principal owns")
    limits = ServerLimits(**{k: getattr(args, k) for k in ServerLimits.model_fields})
    try:
        authority = (AuthoritySource(args.principals, args.trusted_keys)
                     if args.principals else None)
        httpd = make_server(args.root, args.host, args.port, authority=authority,
                            private_reads=args.private_reads, limits=limits)
    except KeyFileError as e:
        ap.error(str(e))
    if authority is not None and not is_loopback(args.host):
        log.warning("serving plain http on %s: clients send tokens only over https or to "
                    "loopback; put a TLS proxy in front", args.host)
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
