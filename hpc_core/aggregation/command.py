"""``hpc-train aggregate``: the command line of one aggregation round (``round.py`` runs it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_core.aggregation.options import (
    DEFAULT_KRUM_F,
    DEFAULT_MIN_UPDATES,
    DEFAULT_TRIM,
    MEDIAN_CLIP,
    Options,
)
from hpc_core.aggregation.output import REPORT_FILE
from hpc_core.aggregation.privacy import DpSettings
from hpc_core.aggregation.report import summary
from hpc_core.aggregation.round import TooFewUpdates, run_round
from hpc_core.aggregation.select import SAMPLES_METRIC, parse_updates
from hpc_core.aggregation.strategies import STRATEGIES
from registry.errors import RegistryError, UsageError

DESCRIPTION = """\
Combine the device uploads of one round into a new model, base + combine(update - release),
written as a checkpoint that `hpc-train publish` takes."""

EPILOG = f"""\
selection: every version of NAME whose parent is --base (a device's direct fine-tune of it)
and, with --max-staleness S, those fine-tuned from the S upstream releases before it (found
through --base's parent links). A stale update's delta, taken against its own release, is
multiplied by 1 / (1 + staleness) ** 0.5 (FedBuff). --updates auto lists the versions, which
only a folder registry can do: over HTTP or S3 name them, --updates V1,V2,...

verification, as a device verifies a pull: a signature by a key in --trusted-keys whose scope
covers NAME@VERSION, the base's model spec and exactly its tensor names, dtypes and shapes,
every chunk's sha256. A version that fails any check is skipped, with the reason, never
combined.

strategies, on each update's delta, first clipped to --clip-norm (L2 over the whole update;
median: to the median of the round's update norms, so an update scaled up counts as an
ordinary one; README "Fleet learning" has what it costs and holds on the benchmark):
  fedavg        weighted mean: weights from training.metrics["{SAMPLES_METRIC}"] when every
                update carries it, else equal
  trimmed-mean  per coordinate, drop the --trim fraction at each end and average the rest
  median        per coordinate median
  krum          the update with the smallest summed squared distance to its N - f - 2
                nearest others (Blanchard et al. 2017; needs N >= 2f + 3); --krum-keep M:
                Multi-Krum, the M best-scored averaged like fedavg (needs N >= M + f)

differential privacy (fedavg; needs a fixed --clip-norm C): DP-FedAvg's fixed-denominator
estimator (McMahan et al. 2018), sum_k w_k * clipped delta_k / W, with w_k = min(samples_k /
--dp-weight-cap, 1) (1 without a cap) and W = --dp-expected-weight, the total weight the
round is expected to bring, fixed in advance (equal weights: the number of updates
expected). One device moves it by at most S = C / W; --dp-noise-multiplier Z adds Gaussian
noise of std Z * S to every coordinate. Under DP a signing key adds one update a round (its
freshest). The report gives Z, S, C, the sampling rate (1) and (epsilon, --dp-delta) per round
and over --dp-rounds rounds from dp-accounting's RDP accountant (pip install -e '.[learn]').

near-identical updates (delta norms within 1e-6, cosine >= 0.9999) are flagged in the report
and on stdout: one update under several keys counts as several devices.

memory: one N x block array at a time (--block-mb), never N models. Output, a new folder:
model.safetensors, trainer_state.json, COMPLETE (the checkpoint layout) and {REPORT_FILE}.

examples:
  hpc-train aggregate --registry /srv/registry --model digits-cnn --base 3 \\
      --strategy fedavg --clip-norm 5 --trusted-keys keys/trusted --out runs/round-3
  hpc-train aggregate --registry /srv/registry --model digits-cnn --base 3 \\
      --strategy trimmed-mean --trim 0.1 --max-staleness 2 --min-updates 8 \\
      --trusted-keys keys/trusted --out runs/round-3
  hpc-train aggregate --registry https://host/registry --model digits-cnn --base 3 \\
      --updates 3+jetson-07.20261126T000000Z.12,3+jetson-08.20261126T001500Z.13 \\
      --strategy median --trusted-keys keys/trusted --out runs/round-3
  hpc-train publish runs/round-3 --registry /srv/registry --name digits-cnn --version 4 \\
      --parent 3 --sign-key keys/upstream.key.pem --artefact runs/round-3/{REPORT_FILE}

exit codes: 0 written; 1 too few usable updates (each skip and its reason on stderr, nothing
written) or a registry failure; 2 bad arguments (an option, the keys, a --base that is not an
upstream release, an existing --out)
"""


def _options(args: argparse.Namespace) -> Options:
    """Options from the command line; UsageError for what argparse cannot see."""
    strategy = args.strategy
    if args.trim is not None and strategy != "trimmed-mean":
        raise UsageError("--trim applies to --strategy trimmed-mean only")
    if (args.krum_f is not None or args.krum_keep is not None) and strategy != "krum":
        raise UsageError("--krum-f and --krum-keep apply to --strategy krum only")
    dp = None
    if args.dp_noise_multiplier is not None:
        if args.dp_delta is None:
            raise UsageError("--dp-noise-multiplier needs --dp-delta (e.g. 1e-5, below 1 / the "
                             "number of devices)")
        if args.dp_expected_weight is None:
            raise UsageError("--dp-noise-multiplier needs --dp-expected-weight W: the total "
                             "weight a round is expected to bring, fixed before it (each "
                             "update weighs at most 1: with equal weights, the number of "
                             "updates expected); the noise is scaled to --clip-norm / W")
        clip = args.clip_norm if isinstance(args.clip_norm, float) else 0.0
        dp = DpSettings(args.dp_noise_multiplier, args.dp_delta, args.dp_rounds or 1, clip,
                        args.dp_expected_weight, args.dp_weight_cap)
    elif (args.dp_delta, args.dp_rounds, args.dp_expected_weight,
          args.dp_weight_cap) != (None,) * 4:
        raise UsageError("--dp-delta, --dp-rounds, --dp-expected-weight and --dp-weight-cap "
                         "go with --dp-noise-multiplier")
    try:
        updates = parse_updates(args.updates)
    except ValueError as e:
        raise UsageError(f"--updates: {e}") from None
    return Options(
        registry=args.registry, model=args.model, base=args.base, strategy=strategy,
        trusted_keys=Path(args.trusted_keys), out=Path(args.out), updates=updates,
        trim=DEFAULT_TRIM if args.trim is None else args.trim,
        krum_f=DEFAULT_KRUM_F if args.krum_f is None else args.krum_f,
        krum_keep=1 if args.krum_keep is None else args.krum_keep,
        clip_norm=args.clip_norm, server_lr=args.server_lr, dp=dp, min_updates=args.min_updates,
        max_staleness=args.max_staleness, block_mb=args.block_mb,
        work_dir=Path(args.work_dir) if args.work_dir else None,
    )


def clip_norm(text: str) -> float | str:
    """``--clip-norm``: a number, or ``median`` (checked with the other options)."""
    if text == MEDIAN_CLIP:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a positive L2 norm such as 5, or {MEDIAN_CLIP}") from None


def run(args: argparse.Namespace) -> int:
    try:
        opts = _options(args)
        report = run_round(opts)
    except TooFewUpdates as e:
        print(e, file=sys.stderr)
        return 1
    except RegistryError as e:
        if isinstance(e, UsageError):
            print(f"aggregate: {e}", file=sys.stderr)
            return 2
        print(f"aggregate: registry failure: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"aggregate: {e}", file=sys.stderr)
        return 1
    print(summary(report, str(opts.out)))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "aggregate",
        help="combine device fine-tunes of a release into a new checkpoint (fleet learning)",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--registry", required=True, metavar="DIR_OR_URI",
                   help="registry folder, file://, http(s):// or s3:// (reads only; a token "
                   "in $EDGETRAIN_REGISTRY_TOKEN is sent only to $EDGETRAIN_REGISTRY)")
    p.add_argument("--model", required=True, metavar="NAME", help="model name, e.g. digits-cnn")
    p.add_argument("--base", required=True, metavar="VERSION",
                   help="the upstream release the devices fine-tuned")
    p.add_argument("--strategy", choices=STRATEGIES, default="fedavg",
                   help="how deltas are combined (default: %(default)s)")
    p.add_argument("--trim", type=float, metavar="FRACTION",
                   help=f"trimmed-mean: fraction dropped at each end (default: {DEFAULT_TRIM})")
    p.add_argument("--krum-f", type=int, metavar="F",
                   help=f"krum: Byzantine updates tolerated (default: {DEFAULT_KRUM_F})")
    p.add_argument("--krum-keep", type=int, metavar="M",
                   help="krum: average the M best-scored updates, Multi-Krum (default: 1, "
                   "Krum's single pick; at most N - f)")
    p.add_argument("--clip-norm", type=clip_norm, metavar="X|median",
                   help="clip each update's delta to this L2 norm, or to the round's median "
                   "update norm (default: no clipping)")
    p.add_argument("--server-lr", type=float, default=1.0, metavar="ETA",
                   help="the aggregate is base + ETA x the combined delta (running "
                   "statistics: x 1): 1 averages; > 1 steps further along the devices' mean "
                   "direction (README: on the digits benchmark it did not help) (default: "
                   "%(default)s)")
    p.add_argument("--dp-noise-multiplier", type=float, metavar="Z",
                   help="central Gaussian DP (fedavg; with --clip-norm, --dp-delta and "
                   "--dp-expected-weight): noise std Z x clip / expected weight")
    p.add_argument("--dp-expected-weight", type=float, metavar="W",
                   help="DP: the total weight a round is expected to bring, fixed in advance "
                   "(each update weighs at most 1; with equal weights the number of updates "
                   "expected): the aggregate is sum of weight x delta / W")
    p.add_argument("--dp-weight-cap", type=float, metavar="SAMPLES",
                   help="DP: an update weighs min(samples / SAMPLES, 1) (default: 1 each, "
                   "whatever sample count it claims)")
    p.add_argument("--dp-delta", type=float, metavar="D", help="delta of the reported (eps, delta)")
    p.add_argument("--dp-rounds", type=int, metavar="R",
                   help="rounds the accountant composes (default: 1)")
    p.add_argument("--min-updates", type=int, default=DEFAULT_MIN_UPDATES, metavar="K",
                   help="fewer usable updates: exit 1, nothing written (default: %(default)s)")
    p.add_argument("--max-staleness", type=int, default=0, metavar="S",
                   help="also take fine-tunes of the S releases before --base (default: 0)")
    p.add_argument("--updates", default="auto", metavar="auto|V1,V2,...",
                   help="the device versions to combine; auto (folder registries only) lists "
                   "them (default: auto)")
    p.add_argument("--trusted-keys", required=True, metavar="DIR",
                   help="public keys (and NAME.scope files) that may sign the base and updates")
    p.add_argument("--out", required=True, metavar="DIR", help="new checkpoint folder to write")
    p.add_argument("--block-mb", type=float, metavar="MB",
                   help="MiB of one N x block array (default: 1/8 of the model, 1 to 64)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="where a remote registry's chunks are cached during the run (default: "
                   "beside --out; removed at the end)")
    p.set_defaults(func=run)
