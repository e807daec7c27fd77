"""``agentctl finetune``: one fine-tune job in the foreground, flags derived from FinetuneJob."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agent.cli.common import add_state_args, fail, registry_of, state_dir_of, trusted_keys_of
from agent.finetune.job import FinetuneJob
from hpc_core.config import ConfigError
from hpc_core.job_args import add_job_arguments, job_tree, validate_job

EPILOG = """\
The job plans its micro-batch from the memory budget before the first step (two short probe
runs), accumulates gradients up to --effective-batch, and is paced by the thermal/power
governor reading --sensors. It writes OUT/report.json and OUT/report.png and prints a summary.

examples:
  agentctl finetune --checkpoint runs/digits --data device.npz --out jobs/j1 --profile sim \\
      --sensors sim --trainable all --epochs 3
  agentctl finetune --checkpoint runs/digits --data /data/cam0 --out jobs/j2 --budget-mb 1500
  agentctl finetune ... --resume          # continue jobs/j2 from its last checkpoint
  agentctl finetune --config job.yaml --set lr=3e-4   # fields of FinetuneJob; flags override

exit codes: 0 done, 1 the job failed, 2 invalid arguments, 3 the model could not be pulled
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a checkpoint on local data within the board's limits",
        description="Fine-tune an upstream checkpoint on this device's data inside a memory "
        "budget, paced by the thermal/power governor. --checkpoint also takes a registry ref "
        "(NAME@VERSION with --registry, or a URL), pulled and verified first.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(p, FinetuneJob)
    p.add_argument(
        "--registry", help="registry for NAME@VERSION refs (default: $EDGETRAIN_REGISTRY)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the job's last checkpoint")
    add_state_args(p)
    p.set_defaults(func=run)


def resolve_checkpoint(text: str, args: argparse.Namespace) -> Path:
    """A local path as is; a registry ref is pulled, verified and installed, then its slot used."""
    local = Path(text)
    if local.exists() or ("@" not in text and "://" not in text):
        return local
    from agent.storage.slots import ModelSlots
    from agent.storage.update import update
    from registry.refs import parse_ref

    ref = parse_ref(text, registry_of(args))
    state_dir = state_dir_of(args)
    update(ref, state_dir=state_dir, trusted=trusted_keys_of(args))
    active = ModelSlots(state_dir, ref.name).active()
    assert active is not None  # update() just switched to it
    return active.path


def run(args: argparse.Namespace) -> int:
    from agent.cli.common import exit_code_of
    from agent.finetune.memory_plan import BudgetTooSmall
    from agent.finetune.recipe import resolve_profile, run_paced
    from device_profiles import ProfileError
    from hpc_core.logs import setup_logging

    setup_logging("auto")
    try:
        tree: dict[str, Any] = job_tree(args)
    except ConfigError as e:
        return fail(2, f"finetune: {e}")
    if isinstance(tree.get("checkpoint"), str):
        try:
            tree["checkpoint"] = str(resolve_checkpoint(tree["checkpoint"], args))
        except Exception as e:
            if exit_code_of(e) is None:
                raise
            return fail(3, f"finetune: --checkpoint {tree['checkpoint']}: {e}")
    try:
        job = validate_job(FinetuneJob, tree, "fine-tune job")
        resolve_profile(job.profile)
    except ConfigError as e:
        return fail(2, f"finetune: {e}")
    except ProfileError as e:
        return fail(2, f"finetune: --profile: {e}")
    try:
        result = run_paced(job, resume=args.resume)
    except (BudgetTooSmall, ValueError) as e:
        return fail(1, f"finetune: {e}")
    _print_summary(result.report, result.target_c)
    print(json.dumps({"report": str(job.out / "report.json"),
                      "checkpoint": result.report["checkpoint"]}))
    return 0


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
