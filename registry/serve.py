"""Serve a registry folder over HTTP: ``python -m registry.serve DIR [--principals FILE
--trusted-keys DIR]``.

What devices pull from and upload to, for a lab, a demo or a single site: GET and HEAD of the
registry's layout (single byte ranges, 206 / 416, so interrupted pulls resume) and, when
started with a principals file, PUT from upstream publishers and devices, each with its own
bearer token. Every write is authorized per object (:mod:`registry.write_rules`): nothing is
overwritten, a chunk must hash to its key, a manifest must be signed by a key its uploader
owns and a device writes only its own versions (the application: :mod:`registry.serve_app`).
Every connection, request and body has a bound (``ServerLimits``, on
:mod:`registry.http_server`). In production put it behind a TLS proxy, or use S3 with the
bucket policy the docs describe (Explanation, "The model registry": "The same on S3").
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from registry.atomic import private_umask
from registry.credentials import is_loopback
from registry.errors import KeyFileError
from registry.http_server import HttpServer
from registry.lifetime import skip_startup_and_exit_collections
from registry.principals import AuthoritySource, add_principal
from registry.serve_app import RegistryApp, ServerLimits
from registry.validation import field_docs
from registry.write_rules import RegistryFolder

log = logging.getLogger("registry.serve")


def make_server(root: Path, host: str = "127.0.0.1", port: int = 0, *,
                authority: AuthoritySource | None = None, private_reads: bool = False,
                limits: ServerLimits | None = None) -> HttpServer:
    """A server bound to (host, port); uploads need ``authority``. Call ``serve_forever()``
    (or ``start()``)."""
    if private_reads and authority is None:
        raise KeyFileError("private reads need principals: give --principals")
    root.mkdir(parents=True, exist_ok=True)
    limits = limits or ServerLimits()
    app = RegistryApp(RegistryFolder(root), authority, private_reads, limits)
    return HttpServer(app, limits=limits.http(), host=host, port=port, name="edgetrain-registry")


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
    defaults, docs = ServerLimits(), field_docs(ServerLimits)
    for name in ServerLimits.model_fields:
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(getattr(defaults, name)),
                        default=getattr(defaults, name), metavar="N",
                        help=f"{docs[name]} (default: %(default)s)")
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
    skip_startup_and_exit_collections()
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
    print(f"http://{args.host}:{httpd.port}", flush=True)
    httpd.serve_forever()  # until SIGTERM or SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
