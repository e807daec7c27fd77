"""``hpc-train keygen`` and ``hpc-train publish``: sign checkpoints into a model registry.

The command line only; the registry protocol is ``registry/``, reading a checkpoint is
``hpc_core.model_spec``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

from hpc_core.aggregation.gates import (
    Aggregate,
    GateOutcome,
    GateSettings,
    read_aggregate,
    read_base,
    run_gates,
)
from hpc_core.config import DataConfig
from hpc_core.model_spec import read_checkpoint
from registry.chunks import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_BELOW
from registry.errors import RegistryError, UsageError
from registry.publish import VersionContent, publish_content
from registry.signing import SCOPE_SUFFIX, generate_keypair, load_signing_key
from registry.stores import RegistryStore, open_store

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

aggregates (the --out folder of `hpc-train aggregate`, which holds aggregate.json): the
manifest's signed training.aggregate records the base release, the device versions combined,
the strategy and the report's sha256; --parent defaults to the base. Gates, each optional,
are checked first; if any fails nothing is published (exit 4). Every figure goes to
AGG_DIR/gates.json and the gate figures into the manifest's training.metrics (gate/...):
  --max-upstream-drop PTS  base and aggregate scored on the upstream held-out split (the
                           validation split of --base-checkpoint's own training config, or of
                           --eval-config); refused when the aggregate's accuracy is more than
                           PTS percentage points below the base's. --base-checkpoint is the
                           checkpoint the base was published from: it must hold exactly the
                           base's signed tensors (sha256 of each), which is simpler and more
                           robust than rebuilding the base from chunks, and it carries the
                           data config, which a manifest does not. When the base was itself
                           an aggregate (round 2 on), that is its aggregate folder, whose
                           config names no data: add --eval-config (the upstream config).
  --device-evals FILE      the devices' own scores, {"evaluations": [{"device": "jetson-01",
                           "samples": 200, "base_accuracy": 0.91, "candidate_accuracy":
                           0.93}, ...]} (accuracies in [0, 1]), read by:
    --min-devices K        fewer than K evaluations: refused
    --max-device-drop PTS  any device whose accuracy drops by more than PTS: refused
    --min-mean-gain PTS    the mean gain (candidate - base, in points) is below PTS: refused;
                           --gain-mean devices (default: every device counts once) or samples
                           (weighted by each device's samples)
  --dry-run                evaluate the gates, write gates.json, publish nothing (exit 0 if
                           every gate passes, 4 if not)

worked example (round 3 of digits-cnn: base 3, aggregate in runs/round-3):
  hpc-train publish runs/round-3 --registry /srv/registry --name digits-cnn --version 4 \\
      --sign-key keys/upstream.key.pem --base-checkpoint runs/digits3 \\
      --max-upstream-drop 1 --device-evals round-3-evals.json --min-devices 5 \\
      --max-device-drop 2 --min-mean-gain 0.5 --dry-run
    pass --max-upstream-drop 1: held-out accuracy dropped 0.3 pts (97.2% -> 96.9%, 359 samples)
    pass --min-devices 5: 6 device evaluation(s) (jetson-01, ...)
    FAIL --max-device-drop 2: jetson-03 dropped 3.4 pts (91.0% -> 87.6%)
    pass --min-mean-gain 0.5: mean gain +1.2 pts over 6 device(s) (plain mean over devices)
  exit 4, nothing published; once every gate passes, the same command without --dry-run
  signs digits-cnn@4 (parent 3) and AGG_DIR/gates.json keeps the figures.

exit codes: 0 published (or, with --dry-run, every gate passed), 1 registry failure,
2 invalid input (checkpoint, key, version, a gate flag without an aggregate, a bad
--device-evals file), 3 refused (a pickle, an unsafe name), 4 refused by the gates (nothing
published)
"""

REFUSED_BY_GATES = 4


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


def _settings(args: argparse.Namespace) -> GateSettings:
    return GateSettings(
        max_upstream_drop=args.max_upstream_drop,
        base_checkpoint=Path(args.base_checkpoint) if args.base_checkpoint else None,
        eval_config=Path(args.eval_config) if args.eval_config else None,
        device_evals=Path(args.device_evals) if args.device_evals else None,
        min_mean_gain=args.min_mean_gain, max_device_drop=args.max_device_drop,
        min_devices=args.min_devices, gain_mean=args.gain_mean, dry_run=args.dry_run,
    )


def _evaluate_upstream(base: Path, candidate: Path, data: DataConfig) -> tuple[float, float, int]:
    from hpc_core.evaluation.upstream import base_and_candidate  # torch: only this gate needs it

    try:
        return base_and_candidate(base, candidate, data)
    except (ValueError, RuntimeError) as e:  # a data path that is gone, weights that misfit
        raise UsageError(f"--max-upstream-drop: cannot score the base and the aggregate: "
                         f"{e}") from None


def _gate(args: argparse.Namespace, agg: Aggregate, settings: GateSettings,
          store: RegistryStore) -> GateOutcome | None:
    """Check the aggregate against its registry and run the gates; None when none is set."""
    if agg.report.model != args.name:
        raise UsageError(f"--name {args.name}, but {agg.folder} aggregates {agg.report.model}: "
                         f"publish it as --name {agg.report.model}")
    base = read_base(store, agg)
    if not settings.any_gate:
        return None
    outcome = run_gates(settings, agg, base, _evaluate_upstream)
    print(f"gates for the aggregate of {agg.base_ref} ({len(agg.report.combined)} updates "
          f"combined):\n{outcome.summary()}\ngate report: {outcome.path}")
    return outcome


def _with_lineage(content: VersionContent, agg: Aggregate,
                  outcome: GateOutcome | None) -> VersionContent:
    metrics = {**content.training.metrics, **(outcome.metrics if outcome else {})}
    training = content.training.model_copy(
        update={"aggregate": agg.lineage(), "metrics": metrics})
    return dataclasses.replace(content, training=training)


def publish(args: argparse.Namespace) -> int:
    try:
        source = Path(args.source)
        agg = read_aggregate(source)
        settings = _settings(args)
        settings.check(source, agg is not None)
        key = load_signing_key(Path(args.sign_key))
        store = open_store(args.registry)
        content = read_checkpoint(source)
        parent = args.parent
        if agg is not None:
            outcome = _gate(args, agg, settings, store)
            if outcome is not None and not outcome.passed:
                print(f"publish: refused by gates, nothing published (figures in "
                      f"{outcome.path}):", file=sys.stderr)
                for line in outcome.failures:
                    print(f"  {line}", file=sys.stderr)
                return REFUSED_BY_GATES
            if settings.dry_run:
                print(f"dry run: every gate passed; would publish {args.name}@{args.version}")
                return 0
            content = _with_lineage(content, agg, outcome)
            parent = parent or agg.report.base.version
        report = publish_content(
            content, store, name=args.name, version=args.version,
            key=key, parent=parent, artefacts=[Path(a) for a in args.artefact],
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


def _points(minimum: float | None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or (minimum is not None and value < minimum):
            raise argparse.ArgumentTypeError(
                f"{text}: want a finite number of percentage points"
                + (f" >= {minimum:g}" if minimum is not None else ""))
        return value
    return parse


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: want a whole number >= 1")
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
    p.add_argument("--parent", metavar="V", help="version this one derives from (must exist; "
                   "default for an aggregate: its base)")
    p.add_argument("--artefact", action="append", default=[], metavar="PATH",
                   help="extra file or folder to ship with the weights (repeatable; no pickles)")
    p.add_argument("--chunk-size-mb", type=_chunk_mb, default=DEFAULT_CHUNK_SIZE / (1 << 20),
                   metavar="MB", help="chunk size in MiB (default: %(default)g)")
    p.add_argument("--pack-below-kb", type=int, default=DEFAULT_PACK_BELOW >> 10, metavar="KB",
                   help="tensors smaller than this share chunks (default: %(default)d KiB)")
    g = p.add_argument_group("gates (an aggregate only; see below)")
    g.add_argument("--max-upstream-drop", type=_points(0), metavar="PTS",
                   help="refuse when the aggregate's upstream held-out accuracy is more than "
                   "PTS points below the base's (needs --base-checkpoint)")
    g.add_argument("--base-checkpoint", metavar="DIR",
                   help="run or checkpoint dir the base release was published from: its "
                   "weights (checked against the base's signed hashes) and its data config")
    g.add_argument("--eval-config", metavar="YAML",
                   help="training config whose data section is the upstream held-out split "
                   "(default: --base-checkpoint's own; needed when that is an aggregate)")
    g.add_argument("--device-evals", metavar="FILE",
                   help="JSON of each device's base and aggregate accuracy (format below)")
    g.add_argument("--min-devices", type=_count, metavar="K",
                   help="refuse with fewer than K device evaluations")
    g.add_argument("--max-device-drop", type=_points(0), metavar="PTS",
                   help="refuse when any device's accuracy drops by more than PTS points")
    g.add_argument("--min-mean-gain", type=_points(None), metavar="PTS",
                   help="refuse when the devices' mean gain is below PTS points (may be "
                   "negative: a tolerated loss)")
    g.add_argument("--gain-mean", choices=("devices", "samples"),
                   help="--min-mean-gain's mean: every device once, or weighted by samples "
                   "(default: devices)")
    g.add_argument("--dry-run", action="store_true",
                   help="evaluate the gates and write gates.json; publish nothing")
    p.set_defaults(func=publish)
