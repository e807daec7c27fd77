"""``agentctl pull | rollback | upload | models | gc``: model updates without the daemon.

For scripts, tests and field debugging: the same code paths the daemon runs, in the foreground.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.cli.common import (
    EXIT_CODES,
    REGISTRY_ENV,
    add_state_args,
    guarded,
    registry_of,
    state_dir_of,
    trusted_keys_of,
)
from agent.storage.gc import GcReport, gc, installed_models
from agent.storage.slots import ModelSlots, SwitchResult
from agent.storage.update import update
from registry.errors import SlotError
from registry.refs import parse_ref
from registry.signing import load_signing_key
from registry.transfer import TransferConfig

PULL_EPILOG = f"""\
REF is NAME@VERSION (resolved against --registry / ${REGISTRY_ENV}) or a full URL to a
version: https://host/registry/NAME/VERSION, file:///srv/registry/NAME/VERSION,
s3://bucket/prefix/NAME/VERSION (needs boto3).

The manifest and its signature are verified against --trusted-keys before any chunk moves;
only chunks missing locally are fetched, partial ones resume with HTTP Range. The version is
assembled into the standby slot and `current` switches atomically; the previous version stays
for `agentctl rollback`. A version whose signed sequence is below the highest installed here
is refused (a rollback attack) unless --allow-downgrade is given. Every request has a total
--deadline-s, and a body slower than --min-rate over --min-rate-window-s is dropped and retried.

examples:
  agentctl pull digits-cnn@3 --registry https://models.example.com/registry
  agentctl pull http://10.0.0.5:8000/registry/digits-cnn/3 --max-rate 2M

{EXIT_CODES}"""

UPLOAD_EPILOG = f"""\
Publishes a fine-tuned checkpoint as a new version whose parent is the installed one, signed
with this device's key (make it with `hpc-train keygen --out KEYDIR --name DEVICE_ID` and
give the cloud DEVICE_ID.pub.pem). Only chunks the registry lacks are sent - usually just the
fine-tuned tensors - and re-running an interrupted upload sends only what is still missing.
The registry must accept writes: a folder, s3://, or an http(s) URL that takes PUT.

example:
  agentctl upload runs/finetune --name digits-cnn --registry s3://fleet-uploads/registry \\
      --sign-key /var/lib/edge-agent/keys/jetson-07.key.pem --artefact exports/

{EXIT_CODES}"""


def _rate(text: str) -> int:
    """Bytes per second, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b/s").removesuffix("/s").removesuffix("b")
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use bytes per second, e.g. 500K or 2M"
        ) from None
    if value < 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: the cap must be at least 1K per second")
    return int(value)


def _min_rate(text: str) -> int:
    return 0 if text.strip() == "0" else _rate(text)


def _transfer(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(
        connect_timeout_s=args.connect_timeout_s,
        read_timeout_s=args.read_timeout_s,
        request_deadline_s=args.deadline_s,
        min_rate_bytes_per_s=args.min_rate,
        min_rate_window_s=args.min_rate_window_s,
        retries=args.retries,
        max_bytes_per_s=args.max_rate,
        connections=args.connections,
        allow_custom_models=getattr(args, "allow_custom_model", False),
        allow_downgrade=getattr(args, "allow_downgrade", False),
    )


@contextmanager
def _progress_bar(enabled: bool, desc: str) -> Iterator[Callable[[int, int], None] | None]:
    """A tqdm bar when stderr is a terminal, nothing in logs and pipes."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)

    def update_bar(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield update_bar
    finally:
        bar.close()


def _describe(switch: SwitchResult) -> str:
    now = f"{switch.name}@{switch.active.version} active (slot {switch.active.slot})"
    if switch.previous is None:
        return now
    return f"{now}; previous {switch.previous.version} (slot {switch.previous.slot})"


def run_pull(args: argparse.Namespace) -> int:
    ref = parse_ref(args.ref, registry_of(args))
    with _progress_bar(not args.no_progress, f"{ref.name}@{ref.version}") as progress:
        result = update(
            ref,
            state_dir=state_dir_of(args),
            trusted=trusted_keys_of(args),
            cfg=_transfer(args),
            progress=progress,
        )
    p = result.pulled
    if not result.switch.changed:
        print(f"{ref.name}@{ref.version} is already active (slot {result.switch.active.slot})")
        return 0
    print(
        f"{_describe(result.switch)}; verified by {p.key.name} ({p.key.key_id}); fetched "
        f"{p.chunks_fetched} chunks ({p.bytes_fetched / 1e6:.2f} MB), reused {p.chunks_reused}; "
        f"{_gc_line(result.gc)}"
    )
    return 0


def _gc_line(report: GcReport) -> str:
    return f"gc removed {report.removed_chunks} chunks ({report.removed_bytes / 1e6:.2f} MB)"


def _only_model(state_dir: Path, name: str | None) -> str:
    if name:
        return name
    names = installed_models(state_dir)
    if len(names) != 1:
        raise SlotError(f"{state_dir} holds models {names or 'none'}: name the one to use")
    return names[0]


def run_rollback(args: argparse.Namespace) -> int:
    state_dir = state_dir_of(args)
    name = _only_model(state_dir, args.name)
    switch = ModelSlots(state_dir, name).rollback(trusted_keys_of(args))
    print(f"rolled back: {_describe(switch)}")
    return 0


def run_upload(args: argparse.Namespace) -> int:
    state_dir = state_dir_of(args)
    name = _only_model(state_dir, args.name)
    key_path = Path(args.sign_key) if args.sign_key else state_dir / "keys" / "device.key.pem"
    metrics: dict[str, float] = {}
    if args.metrics:
        metrics = json.loads(Path(args.metrics).read_text())
        if not isinstance(metrics, dict):
            raise ValueError(f"{args.metrics}: expected a JSON object of metric name -> number")
    from hpc_core.model_spec import read_checkpoint  # torch: only for this command
    from registry.upload import upload

    parent = ModelSlots(state_dir, name).installed(args.parent)
    content = read_checkpoint(Path(args.checkpoint))
    with _progress_bar(not args.no_progress, f"upload {name}") as progress:
        report = upload(
            content,
            parent=parent.manifest,
            target=args.registry,
            key=load_signing_key(key_path),
            version=args.version,
            artefacts=[Path(a) for a in args.artefact],
            metrics=metrics,
            cfg=_transfer(args),
            progress=progress,
        )
    print(report.summary())
    return 0


def run_models(args: argparse.Namespace) -> int:
    state_dir = state_dir_of(args)
    names = installed_models(state_dir)
    if not names:
        print(f"no models installed in {state_dir}")
    for name in names:
        slots = ModelSlots(state_dir, name)
        active, standby = slots.active(), slots.standby()
        line = f"{name}: active {active.version if active else '-'}"
        if active is not None:
            # The key that verified the version at install, not the signer the manifest claims.
            line += (f" (slot {active.slot}, sequence {active.manifest.sequence}, verified by "
                     f"{active.verified_by})")
        line += f"; standby {standby.version if standby else '-'}"
        line += f"; highest sequence {slots.highest_sequence()}"
        print(line)
    return 0


def run_gc(args: argparse.Namespace) -> int:
    print(_gc_line(gc(state_dir_of(args))))
    return 0


def _network(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network")
    g.add_argument(
        "--max-rate",
        type=_rate,
        metavar="RATE",
        help="bandwidth cap in bytes/s, e.g. 500K or 2M (default: none)",
    )
    g.add_argument(
        "--connections",
        type=int,
        default=4,
        metavar="N",
        help="parallel transfers (default: %(default)s)",
    )
    g.add_argument(
        "--connect-timeout-s",
        type=float,
        default=10.0,
        metavar="S",
        help="connect timeout per attempt (default: %(default)s)",
    )
    g.add_argument(
        "--read-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="longest silence while reading (default: %(default)s)",
    )
    g.add_argument(
        "--deadline-s",
        type=float,
        default=900.0,
        metavar="S",
        help="total time per request, retries included (default: %(default)s)",
    )
    g.add_argument(
        "--min-rate",
        type=_min_rate,
        default=1024,
        metavar="RATE",
        help="drop and retry a transfer slower than this, e.g. 1K; 0 = off (default: 1K)",
    )
    g.add_argument(
        "--min-rate-window-s",
        type=float,
        default=30.0,
        metavar="S",
        help="window over which --min-rate is measured (default: %(default)s)",
    )
    g.add_argument(
        "--retries",
        type=int,
        default=8,
        metavar="N",
        help="attempts without progress before giving up (default: %(default)s)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar even at a terminal")


def register(subparsers: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "pull",
        help="verify, download (delta, resumable) and install a model version",
        description="Pull a signed model version and make it active (A/B slots).",
        epilog=PULL_EPILOG,
        formatter_class=fmt,
    )
    p.add_argument("ref", metavar="REF", help="NAME@VERSION or a URL to NAME/VERSION")
    p.add_argument("--registry", metavar="URL", help=f"registry root (default: ${REGISTRY_ENV})")
    p.add_argument(
        "--allow-downgrade",
        action="store_true",
        help="install even if the version's signed sequence is below the highest installed "
        "(logged)",
    )
    p.add_argument(
        "--allow-custom-model",
        action="store_true",
        help="accept model specs naming a Python factory (pkg.mod:fn) to import",
    )
    add_state_args(p)
    _network(p)
    p.set_defaults(func=guarded(run_pull))

    r = subparsers.add_parser(
        "rollback",
        help="switch back to the previous installed version (atomic)",
        description="Re-verify the standby slot, then make it active with one atomic rename. "
        "Rolling back twice returns to where you started.",
        epilog=EXIT_CODES,
        formatter_class=fmt,
    )
    r.add_argument("name", nargs="?", metavar="NAME", help="model name (optional if only one)")
    add_state_args(r)
    r.set_defaults(func=guarded(run_rollback))

    u = subparsers.add_parser(
        "upload",
        help="publish a fine-tuned checkpoint back to the registry, device-signed",
        description="Upload a fine-tuned checkpoint as a new version (parent: the installed one).",
        epilog=UPLOAD_EPILOG,
        formatter_class=fmt,
    )
    u.add_argument("checkpoint", metavar="CHECKPOINT", help="fine-tune run dir or checkpoint dir")
    u.add_argument(
        "--registry",
        required=True,
        metavar="URI",
        help="writable registry: folder, s3://BUCKET/PREFIX or http(s) URL taking PUT",
    )
    u.add_argument("--name", metavar="N", help="model name (optional if only one is installed)")
    u.add_argument(
        "--version",
        metavar="V",
        help="new version (default: PARENT+KEYNAME.UTCTIME, e.g. 3+jetson-07.20250101T120000Z)",
    )
    u.add_argument(
        "--parent", metavar="V", help="installed version it derives from (default: the active one)"
    )
    u.add_argument(
        "--sign-key",
        metavar="KEY",
        help="this device's private key (default: STATE_DIR/keys/device.key.pem)",
    )
    u.add_argument(
        "--artefact",
        action="append",
        default=[],
        metavar="PATH",
        help="export artefact file or folder to include (repeatable; no pickles)",
    )
    u.add_argument("--metrics", metavar="FILE", help="JSON object of extra metrics to record")
    add_state_args(u, trusted=False)
    _network(u)
    u.set_defaults(func=guarded(run_upload))

    m = subparsers.add_parser(
        "models",
        help="list installed models, active and standby versions",
        description="List installed models with their A/B slots.",
    )
    add_state_args(m, trusted=False)
    m.set_defaults(func=guarded(run_models))

    g = subparsers.add_parser(
        "gc",
        help="delete chunks no installed version needs, and partial downloads",
        description="Garbage-collect the chunk store (pull does this after each install).",
    )
    add_state_args(g, trusted=False)
    g.set_defaults(func=guarded(run_gc))
