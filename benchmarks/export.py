"""What INT8, 2:4 sparsity and channel pruning buy on this CPU, side by side in one run.

Trains small_cnn (width 32) on digits upsampled to 32 px through ``hpc_core.Trainer`` (or
takes ``--checkpoint``), runs the export pipeline four times (FP32; INT8; 2:4 + recovery +
INT8; channels:0.5 + recovery + INT8), then times every artefact in interleaved rounds with
the same settings:

    torch eager FP32 | ORT FP32 | ORT INT8 | ORT INT8 + 2:4 | ORT INT8 + channels:0.5

Latency p50/p99 at batch 1 and 32, top-1 on the held-out split, file size, and the ORT FP32 /
ORT INT8 latency ratio at batch 32 (target >= 2x, with INT8 within 1 point and the pruned
variants within 2 points of FP32).

    python benchmarks/export.py [--checkpoint DIR] [--image-size 32] [--threads 1] [--iters 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exporters.job import ExportJob
from exporters.pipeline import run_export
from exporters.runtime import OrtRunner, TorchRunner, batch_of, predict
from hpc_core.checkpoint import load_model, resolve_checkpoint
from hpc_core.config import config_from_dict
from hpc_core.data import build_datasets, held_out
from hpc_core.trainer import Trainer

VARIANTS = [
    # (label, job fields)
    ("ORT FP32", {"precision": "fp32"}),
    ("ORT INT8", {"precision": "int8"}),
    ("ORT INT8 + 2:4", {"precision": "int8", "prune": "2:4"}),
    ("ORT INT8 + channels:0.5", {"precision": "int8", "prune": "channels:0.5"}),
]


def train(out: Path, image_size: int, epochs: int) -> Path:
    cfg = config_from_dict({
        "run": {"name": "bench-export", "output_dir": str(out), "seed": 0},
        "data": {"source": "digits", "image_size": image_size},
        "model": {"name": "small_cnn", "kwargs": {"width": 32}},
        "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 20, "decay": "cosine"},
        "training": {"global_batch_size": 64, "epochs": epochs, "device": "cpu"},
        "checkpoint": {"best_metric": None},
        "logging": {"progress": "off"},
    })
    result = Trainer(cfg).train()
    assert result.checkpoint_dir is not None
    print(f"trained small_cnn at {image_size} px: eval/acc {result.metrics['eval/acc']:.4f}")
    return result.checkpoint_dir


def timed_rounds(
    runners: dict[str, Callable[[np.ndarray], np.ndarray]], x: np.ndarray, iters: int,
    rounds: int = 5,
) -> dict[str, dict[str, float]]:
    """p50/p99 per runner; runners take turns in rounds so drift hits all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        for _ in range(5):
            run(x)
    for _ in range(rounds):
        for name, run in runners.items():
            for _ in range(max(1, iters // rounds)):
                t0 = time.perf_counter()
                run(x)
                samples[name].append(time.perf_counter() - t0)
    return {
        name: {"p50_ms": float(np.percentile(s, 50) * 1e3),
               "p99_ms": float(np.percentile(s, 99) * 1e3)}
        for name, s in samples.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="use this checkpoint instead of training")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--recovery-steps", type=int, default=300,
                    help="fine-tune steps after pruning")
    ap.add_argument("--threads", type=int, default=1,
                    help="ORT intra-op threads and torch threads (1 = one core, as on a "
                    "device that is also fine-tuning)")
    ap.add_argument("--iters", type=int, default=200, help="timed runs per variant and batch")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="bench-export-"))
    ckpt = resolve_checkpoint(args.checkpoint) if args.checkpoint else train(
        work / "run", args.image_size, args.epochs)
    model, cfg = load_model(ckpt)
    model.eval()
    _, val, _ = build_datasets(cfg.data)
    x, y = held_out(val, None)

    runners: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "torch eager FP32": TorchRunner(model)
    }
    sizes = {"torch eager FP32": (ckpt / "model.safetensors").stat().st_size}
    notes: dict[str, str] = {}
    for label, fields in VARIANTS:
        out = work / label.replace(" ", "_").replace(":", "").replace("+", "")
        job = ExportJob(checkpoint=ckpt, out_dir=out, fallback={"enabled": False},
                        recovery={"steps": args.recovery_steps},
                        gates={"max_top1_drop_pts": None, "latency_iters": 5}, **fields)
        report = run_export(job)
        if report.status != "passed":
            raise SystemExit(f"{label}: export failed: {report.fallback_reason}")
        runners[label] = OrtRunner(out / "model.onnx", threads=args.threads)
        sizes[label] = (out / "model.onnx").stat().st_size
        if report.prune:
            notes[label] = (f"sparsity {report.prune['sparsity'] * 100:.0f}%, FLOPs "
                            f"{report.model['flops_before'] / 1e6:.1f}M -> "
                            f"{report.model['flops_after'] / 1e6:.1f}M")

    acc = {name: float((predict(run, x).argmax(1) == y).mean()) for name, run in runners.items()}
    b1 = timed_rounds(runners, x[:1], args.iters)
    b32 = timed_rounds(runners, batch_of(x, 32), args.iters)

    ref = acc["torch eager FP32"]
    head = f"{'variant':<25} {'top-1 %':>8} {'drop pts':>9} {'b1 p50/p99 ms':>15} " \
           f"{'b32 p50/p99 ms':>16} {'size KB':>8}  {'vs ORT FP32 b32':>15}"
    print(f"\nsmall_cnn width 32, {cfg.model.image_size}x{cfg.model.image_size} digits, "
          f"{len(y)} held-out samples, {args.threads} thread(s), {args.iters} runs per cell")
    print(head)
    print("-" * len(head))
    base = b32["ORT FP32"]["p50_ms"]
    for name in runners:
        print(f"{name:<25} {acc[name] * 100:>8.2f} {(ref - acc[name]) * 100:>+9.2f} "
              f"{b1[name]['p50_ms']:>7.3f}/{b1[name]['p99_ms']:<7.3f} "
              f"{b32[name]['p50_ms']:>7.2f}/{b32[name]['p99_ms']:<8.2f} "
              f"{sizes[name] / 1e3:>8.1f}  {base / b32[name]['p50_ms']:>14.2f}x")
    for name, note in notes.items():
        print(f"  {name}: {note}")
    ratio = base / b32["ORT INT8"]["p50_ms"]
    drop = (acc["ORT FP32"] - acc["ORT INT8"]) * 100
    print(f"\nORT INT8 vs ORT FP32 at batch 32: {ratio:.2f}x faster (target >= 2x: "
          f"{'met' if ratio >= 2 else 'NOT met'}); INT8 top-1 drop {drop:+.2f} pts "
          f"(bound 1.0: {'met' if drop <= 1.0 else 'NOT met'})")
    if args.json:
        figures: dict[str, Any] = {"accuracy": acc, "b1": b1, "b32": b32, "size_bytes": sizes,
                                   "int8_speedup_b32": ratio, "threads": args.threads}
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
