"""agentctl finetune / profiles: run one fine-tune job in the foreground."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from agent.cli.common import add_state_args, registry_of, state_dir_of, trusted_keys_of

EPILOG = """\
The job plans its micro-batch from the memory budget before the first step (two short probe
runs), accumulates gradients up to --effective-batch, and is paced by the thermal/power
governor reading --sensors. It writes OUT/report.json and OUT/report.png and prints a summary.

examples:
  agentctl finetune --checkpoint runs/digits --data device.npz --out jobs/j1 --profile sim \\
      --sensors sim --trainable all --epochs 3
  agentctl finetune --checkpoint runs/digits --data /data/cam0 --out jobs/j2 --budget-mb 1500
  agentctl finetune ... --resume          # continue jobs/j2 from its last checkpoint

exit codes: 0 done, 1 the job failed, 2 invalid arguments, 3 the model could not be pulled
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a checkpoint on local data within the board's limits",
        description="Fine-tune an upstream checkpoint on this device's data inside a memory "
        "budget, paced by the thermal/power governor.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="REF|DIR",
        help="checkpoint or run directory, an installed slot, or a registry ref "
        "(NAME@VERSION with --registry, or a URL) to pull and verify first",
    )
    p.add_argument(
        "--registry", help="registry for NAME@VERSION refs (default: $EDGETRAIN_REGISTRY)"
    )
    p.add_argument(
        "--data", required=True, type=Path, help="image folder (class sub-folders) or .npz"
    )
    p.add_argument("--out", required=True, type=Path, help="job directory")
    p.add_argument(
        "--profile", default="auto", help="device profile name or auto (see `agentctl profiles`)"
    )
    p.add_argument("--budget-mb", type=float, help="memory budget (default: the profile's)")
    p.add_argument("--effective-batch", type=int, default=64, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, help="skip planning and use this micro-batch")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps")
    length.add_argument("--epochs", type=int, help="passes over the device data (default 3)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--trainable", default="head", help="head | last_n:K | all (default head)")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute activations in backward: less memory, more compute",
    )
    p.add_argument("--precision", choices=["auto", "fp32", "fp16", "bf16"], default="auto")
    p.add_argument(
        "--sensors",
        default="auto",
        choices=["auto", "jtop", "tegrastats", "sysfs", "sim", "none"],
        help="sensor backend for the governor (none: no pacing)",
    )
    p.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        help="with --sensors sim: simulated seconds per real second (60 shows a "
        "board heating up within a short demo job)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the job's last checkpoint")
    add_state_args(p)
    p.set_defaults(func=run)


def resolve_checkpoint_arg(args: argparse.Namespace) -> Path:
    """A local path as is; a registry ref is pulled, verified and installed, then its slot used."""
    local = Path(args.checkpoint)
    if local.exists() or ("@" not in args.checkpoint and "://" not in args.checkpoint):
        return local
    from agent.slots import ModelSlots
    from agent.sync import parse_ref, update

    ref = parse_ref(args.checkpoint, registry_of(args))
    state_dir = state_dir_of(args)
    update(ref, state_dir=state_dir, trusted=trusted_keys_of(args))
    active = ModelSlots(state_dir, ref.name).active()
    assert active is not None  # update() just switched to it
    return active.path


def run(args: argparse.Namespace) -> int:
    from agent.finetune import FinetuneJob, resolve_profile, run_finetune
    from agent.governor import Governor, GovernorConfig, GovernorHook
    from agent.memory_plan import BudgetTooSmall
    from agent.report import Limits, build_report, write_report
    from agent.sensors import open_backend
    from device_profiles import ProfileError
    from hpc_core.logs import setup_logging

    setup_logging("auto")
    from agent.slots import SlotError
    from agent.sync import SyncError
    from hpc_core.manifest import ManifestError
    from hpc_core.signing import KeyFileError

    try:
        checkpoint = resolve_checkpoint_arg(args)
    except (SyncError, ManifestError, SlotError, KeyFileError, OSError) as e:
        print(f"agentctl finetune: --checkpoint {args.checkpoint}: {e}", file=sys.stderr)
        return 3
    try:
        job = FinetuneJob(
            checkpoint=checkpoint,
            data=args.data,
            out=args.out,
            profile=args.profile,
            budget_mb=args.budget_mb,
            effective_batch=args.effective_batch,
            micro_batch=args.micro_batch,
            steps=args.steps,
            epochs=args.epochs,
            lr=args.lr,
            optimizer=args.optimizer,
            trainable=args.trainable,
            activation_checkpointing=args.activation_checkpointing,
            precision=args.precision,
        )
        profile = resolve_profile(job.profile)
    except ValidationError as e:
        for err in e.errors():
            print(
                f"agentctl finetune: --{_flag(err['loc'])}: {err['msg']}",
                file=sys.stderr,
            )
        return 2
    except ProfileError as e:
        print(f"agentctl finetune: --profile: {e}", file=sys.stderr)
        return 2

    hook = None
    sensors_cm = (
        contextlib.nullcontext()
        if args.sensors == "none"
        else open_backend(args.sensors, profile=profile, sim_time_scale=args.sim_time_scale)
    )
    with sensors_cm as sensors:
        if sensors is not None:
            hook = GovernorHook(
                Governor(GovernorConfig.from_profile(profile), profile=profile), sensors
            )
        try:
            result = run_finetune(job, hooks=[hook] if hook else [], resume=args.resume)
        except (BudgetTooSmall, ValueError) as e:
            print(f"agentctl finetune: {e}", file=sys.stderr)
            return 1
    report = result.report
    t = profile.thermal
    if hook is not None:
        limits = Limits(
            target_c=t.throttle_target_c,
            soft_pause_c=t.soft_pause_c,
            board_throttle_c=t.board_throttle_c,
            critical_c=t.critical_c,
        )
        governed = build_report(hook, limits, job=report, extra_summary=_summary(report))
        # One report per job: the fine-tune's figures under "job", pacing over time beside them.
        write_report(governed, job.out, stem="report")
        report["governor"] = governed.summary
    _print_summary(report, t.throttle_target_c)
    print(json.dumps({"report": str(job.out / "report.json"), "checkpoint": report["checkpoint"]}))
    return 0


def _flag(loc: tuple) -> str:
    return "-".join(map(str, loc)).replace("_", "-")


def _summary(report: dict) -> dict:
    keys = ("accuracy_before", "accuracy_after", "peak_rss_mb", "budget_mb", "micro_batch_size")
    return {k: report[k] for k in keys}


def _print_summary(r: dict, target_c: float) -> None:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    plan = r.get("memory_plan") or {}
    gov = r.get("governor") or {}
    max_t = gov.get("max_temp_c")
    rows = [
        (
            "accuracy (held-out device data)",
            f"{pct(r['accuracy_before'])} -> {pct(r['accuracy_after'])}",
        ),
        (
            "micro-batch x accumulation",
            f"{r['micro_batch_size']} x {plan.get('accumulation_steps', 1)}"
            + (f" (planned: {plan['method']})" if plan else " (given)"),
        ),
        ("peak memory vs budget", f"{r['peak_rss_mb']:.0f} MB / {r['budget_mb']:.0f} MB"),
        (
            "max temperature vs target",
            "n/a" if max_t is None else f"{max_t:.1f} C / {target_c:.1f} C",
        ),
        ("steps, stop reason", f"{r['steps']}, {r['stopped_reason']}"),
        ("precision, device, profile", f"{r['precision']}, {r['device']}, {r['profile']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=sys.stderr)
