"""``hpc-train keygen`` and ``hpc-train publish``: sign checkpoints into a model registry.

The command line only; the registry protocol is ``registry/``, reading a checkpoint is
``hpc_core.model_spec``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_core.model_spec import read_checkpoint
from registry.chunks import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_BELOW
from registry.errors import RegistryError
from registry.publish import publish_content
from registry.signing import SCOPE_SUFFIX, generate_keypair, load_signing_key
from registry.stores import open_store

KEYGEN_EPILOG = """\
Writes NAME.key.pem (private, mode 0600: keep it on the publishing host or device) and
NAME.pub.pem (public: copy it into each device's trusted-keys folder, e.g.
/var/lib/edge-agent/trusted_keys/). Existing keys are never overwritten. --scope also writes
NAME.scope, the models the key may sign (copy it beside NAME.pub.pem); without it the key may
sign every model, as the upstream publisher's does.

examples:
  hpc-train keygen --out keys/ --name upstream
  hpc-train keygen --out /var/lib/edge-agent/keys --name jetson-07 \\
      --scope 'digits-cnn@*+jetson-07.*'     # a device key: only its own uploads
"""

PUBLISH_EPILOG = """\
RUN_OR_CHECKPOINT is a run dir (its checkpoints/final/, else the latest step) or one
checkpoint dir. Only the model weights are published (optimizer and RNG state stay here),
with the model spec, the config digest and the metrics. Chunks the registry already holds
are not written again, so a version that changes 10% of the tensors costs ~10% of the bytes.

registry layout (serve the folder with any static HTTP server or CDN):
  REGISTRY/chunks/sha256/ab/abcd...        content-addressed chunks, shared by versions
  REGISTRY/NAME/VERSION/manifest.json      tensors, chunks, model spec, metrics, parent
  REGISTRY/NAME/VERSION/manifest.sig       Ed25519 signature of manifest.json
  REGISTRY/NAME/_sequence.json             the highest sequence published (versions get the next)

examples:
  hpc-train publish runs/digits --registry /srv/registry --name digits-cnn --version 1 \\
      --sign-key keys/upstream.key.pem
  hpc-train publish runs/digits2 --registry s3://models/edgetrain --name digits-cnn \\
      --version 2 --parent 1 --sign-key keys/upstream.key.pem --artefact exports/model.onnx

exit codes: 0 published, 1 registry failure, 2 invalid input (checkpoint, key, version),
3 refused (a pickle, an unsafe name)
"""


def keygen(args: argparse.Namespace) -> int:
    try:
        priv, pub = generate_keypair(Path(args.out), args.name, scope=args.scope)
    except (RegistryError, OSError) as e:
        print(f"keygen: {e}", file=sys.stderr)
        return 2
    # A device's own key signs only that device's versions (scope NAME@*+DEVICE.*): it lives
    # on that device; an upstream key never goes near one.
    device_key = bool(args.scope) and all(f"+{args.name}." in p for p in args.scope)
    if device_key:
        print(f"private key: {priv}  (mode 0600; device {args.name}'s own signing key: keep "
              "it on that device, registry.signing_key in its agent.yaml)")
        print(f"public key:  {pub}  (copy into that device's trusted-keys folder and the "
              "registry's --trusted-keys)")
    else:
        print(f"private key: {priv}  (mode 0600; never copy it to devices)")
        print(f"public key:  {pub}  (copy into each device's trusted-keys folder)")
    if args.scope:
        print(f"key scope:   {pub.with_name(f'{args.name}{SCOPE_SUFFIX}')}  (may sign "
              f"{', '.join(args.scope)}; copy it beside the public key)")
    return 0


def publish(args: argparse.Namespace) -> int:
    try:
        key = load_signing_key(Path(args.sign_key))
        store = open_store(args.registry)
        report = publish_content(
            read_checkpoint(Path(args.source)), store, name=args.name, version=args.version,
            key=key, parent=args.parent, artefacts=[Path(a) for a in args.artefact],
            chunk_size=int(args.chunk_size_mb * (1 << 20)), pack_below=args.pack_below_kb << 10,
        )
    except RegistryError as e:
        prefix = "registry failure: " if e.exit_code == 1 else ""
        print(f"publish: {prefix}{e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"publish: registry failure: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


def _chunk_mb(text: str) -> float:
    value = float(text)
    if not 1 / 256 <= value <= 1024:
        raise argparse.ArgumentTypeError("chunk size must be between 1/256 and 1024 MiB")
    return value


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    k = subparsers.add_parser(
        "keygen",
        help="make an Ed25519 key pair (PEM) for signing published versions",
        description="Make an Ed25519 key pair for signing registry manifests.",
        epilog=KEYGEN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    k.add_argument("--out", required=True, metavar="DIR", help="folder to write the key pair into")
    k.add_argument("--name", default="upstream", metavar="N",
                   help="key name: the file stem and the signer name in manifests "
                   "(default: upstream)")
    k.add_argument("--scope", action="append", default=[], metavar="PATTERN",
                   help="a model name or NAME@VERSION pattern the key may sign, written to "
                   "NAME.scope (repeatable; default: no scope file, every model)")
    k.set_defaults(func=keygen)

    p = subparsers.add_parser(
        "publish",
        help="sign a checkpoint into a model registry (folder or s3://)",
        description="Publish a checkpoint's weights as NAME@VERSION: content-addressed chunks, "
        "a manifest and its Ed25519 signature.",
        epilog=PUBLISH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run dir or checkpoint dir")
    p.add_argument("--registry", required=True, metavar="DIR_OR_URI",
                   help="registry folder, file:// URI, s3://BUCKET/PREFIX (needs boto3) or an "
                   "http(s) URL that takes PUT (registry.serve: the publisher's token in "
                   "$EDGETRAIN_REGISTRY_TOKEN, sent only to the registry in $EDGETRAIN_REGISTRY)")
    p.add_argument("--name", required=True, metavar="N", help="model name, e.g. digits-cnn")
    p.add_argument("--version", required=True, metavar="V", help="new version, e.g. 3 or 2025.06.1")
    p.add_argument("--sign-key", required=True, metavar="KEY",
                   help="private key (NAME.key.pem) from `hpc-train keygen`")
    p.add_argument("--parent", metavar="V", help="version this one derives from (must exist)")
    p.add_argument("--artefact", action="append", default=[], metavar="PATH",
                   help="extra file or folder to ship with the weights (repeatable; no pickles)")
    p.add_argument("--chunk-size-mb", type=_chunk_mb, default=DEFAULT_CHUNK_SIZE / (1 << 20),
                   metavar="MB", help="chunk size in MiB (default: %(default)g)")
    p.add_argument("--pack-below-kb", type=int, default=DEFAULT_PACK_BELOW >> 10, metavar="KB",
                   help="tensors smaller than this share chunks (default: %(default)d KiB)")
    p.set_defaults(func=publish)
