"""Fine-tuning inside a memory budget, and pacing under a thermal limit.

1. Memory: the same fine-tune job (small_cnn, GroupNorm, digits at 48x48, effective batch 256)
   run unbounded and at a budget, each in its own process. Prints the micro-batch the planner
   chose, peak RSS against the budget and the throughput ratio (target >= 0.85x).
2. Thermal: governor vs bang-bang vs no control on the simulated Orin Nano 8GB in a 35 C
   enclosure (see benchmarks/governor.py), and the plot for the README.

    python benchmarks/finetune.py [--budget-mb 700] [--steps 12] [--plot PNG] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchmarks.harness import parse_args, verdict  # noqa: E402


def run_job(up: Path, data: Path, out: Path, steps: int, batch: int, extra: dict) -> dict:
    kw = {
        "checkpoint": str(up),
        "data": str(data),
        "out": str(out),
        "profile": "generic-x86",
        "trainable": "all",
        "steps": steps,
        "effective_batch": batch,
        "optimizer": "sgd",
        "lr": 0.05,
        **extra,
    }
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    p = subprocess.run(
        [sys.executable, "-m", "agent.finetune", json.dumps(kw)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    report = json.loads(p.stdout.strip().splitlines()[-1])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # Skip the first window: it carries loader and allocator warm-up.
    all_rates = [m["samples_per_s"] for m in lines if "samples_per_s" in m]
    rates = all_rates[1:]
    report["samples_per_s"] = statistics.median(rates or all_rates)
    return report


def memory_section(budget_mb: float, steps: int, image_size: int = 48,
                   batch: int = 256) -> tuple[float, float]:
    """(throughput at the budget / unbounded, peak RSS at the budget / the budget)."""
    from make_device_data import make_device_data

    from hpc_core.config import load_config
    from hpc_core.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        cfg = load_config(
            REPO / "configs/digits.yaml",
            [
                f"run.output_dir={t / 'up'}",
                f"data.image_size={image_size}",
                "model.kwargs={width: 16, norm: group}",
                "training.max_steps=2",
                "logging.progress=off",
            ],
        )
        Trainer(cfg).train()
        data = make_device_data(t / "device.npz", ["invert"], image_size=image_size)
        free = run_job(t / "up", data, t / "free", steps, batch, {"micro_batch": batch})
        bound = run_job(t / "up", data, t / "bound", steps, batch, {"budget_mb": budget_mb})
    plan = bound["memory_plan"]
    print(
        f"memory: small_cnn(GroupNorm) on {image_size}x{image_size} digits, effective batch "
        f"{batch}, {steps} steps, "
        "1 thread"
    )
    print(f"{'':22}{'micro x accum':>15}{'peak RSS MB':>13}{'samples/s':>11}")
    for name, r, acc in (
        ("unbounded", free, 1),
        (f"budget {budget_mb:.0f} MB", bound, plan["accumulation_steps"]),
    ):
        shape = f"{r['micro_batch_size']} x {acc}"
        print(f"{name:22}{shape:>15}{r['rss_mb']:13.0f}{r['samples_per_s']:11.1f}")
    print(
        f"plan: {plan['base_mb']:.0f} MB fixed + {plan['per_sample_mb']:.2f} MB/sample, "
        f"start-up peak {plan.get('startup_mb', 0.0):.0f} MB "
        f"(probes {plan['probes']}), predicted peak {plan['predicted_tree_peak_mb']:.0f} MB"
    )
    ratio = bound["samples_per_s"] / free["samples_per_s"]
    print(
        f"peak RSS / budget: {bound['rss_mb'] / budget_mb:.3f} (target <= 1.05); unbounded "
        f"peak / budget: {free['rss_mb'] / budget_mb:.2f}"
    )
    print(f"throughput at budget / unbounded: {ratio:.3f} (target >= 0.85)")
    return ratio, bound["rss_mb"] / budget_mb


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--budget-mb", type=float, default=700.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--image-size", type=int, default=48)
    p.add_argument("--effective-batch", type=int, default=256,
                   help="the planner probes min(16, this) and its half and quarter, twice each")
    p.add_argument("--plot", type=Path, default=REPO / "benchmarks/out/governor.png")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-thermal", action="store_true")
    args = parse_args(
        p, {"steps": 2, "image_size": 16, "effective_batch": 1,
            "plot": Path(tempfile.gettempdir()) / "governor-quick.png"}
    )
    memory = None if args.skip_memory else memory_section(
        args.budget_mb, args.steps, args.image_size, args.effective_batch)
    if not args.skip_thermal:
        print(flush=True)
        subprocess.run(
            [sys.executable, str(REPO / "benchmarks/governor.py"), "--plot", str(args.plot),
             *(["--quick"] if args.quick else [])],
            check=True,
        )
    if memory is not None:  # else the governor's verdict was the last line
        ratio, peak = memory
        verdict("fine-tune throughput at the budget / unbounded ratio", ratio, ">=", 0.85,
                also=[("peak RSS / budget <= 1.05", peak <= 1.05)])


if __name__ == "__main__":
    main()
