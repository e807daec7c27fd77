"""Learning-rate range test (Leslie Smith; fastai's lr_find): ``hpc-train lr-find``.

The LR grows exponentially from ``min_lr`` to ``max_lr``, one real optimizer step of the
trainer per value (same micro-batching, precision and clipping as training). The loss is
smoothed with a bias-corrected exponential moving average; the sweep stops early once the
smoothed loss exceeds ``diverge_factor`` times its minimum. The suggestion is the LR where the
smoothed loss falls fastest against log(LR), searched only before the minimum (past it the
loss is already blowing up).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpc_core.config import ConfigError, TrainConfig, load_config

if TYPE_CHECKING:  # torch at run time only: `hpc-train --help` and its torch-free commands
    import torch


@dataclass
class LRFindResult:
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float
    seconds: float
    stopped: str
    """ran to max_lr | diverged"""


def lr_range_test(
    cfg: TrainConfig,
    *,
    min_lr: float = 1e-6,
    max_lr: float = 1.0,
    steps: int = 100,
    beta: float = 0.9,
    diverge_factor: float = 4.0,
) -> LRFindResult:
    from hpc_core.trainer import Trainer, TrainingDiverged

    if not 0 < min_lr < max_lr:
        raise ValueError(f"need 0 < min_lr < max_lr, got {min_lr} and {max_lr}")
    if steps < 10:
        raise ValueError(f"steps={steps}: use at least 10 for a usable curve")
    cfg = cfg.model_copy(deep=True)
    # A probe, not a run: constant LR set per step, no checkpoints, metrics in a scratch folder.
    cfg.schedule.warmup_steps = 0
    cfg.schedule.decay = "constant"
    cfg.checkpoint.best_metric = None
    cfg.logging.progress = "off"
    cfg.faults.max_nan_rollbacks = 0  # a non-finite loss ends the sweep instead of a rollback
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lr-find-") as scratch:
        cfg.run.output_dir = Path(scratch)
        trainer = Trainer(cfg)
        lrs, losses, smoothed = [], [], []
        avg, best, stopped = 0.0, math.inf, "ran to max_lr"
        batches = _endless(trainer)
        for i in range(steps):
            lr = min_lr * (max_lr / min_lr) ** (i / (steps - 1))
            trainer.cfg.optimizer.lr = lr
            try:
                loss = trainer.train_step(*next(batches))["loss"]  # type: ignore[index]
            except TrainingDiverged:
                loss = math.inf
            lrs.append(lr)
            losses.append(loss)
            if not math.isfinite(loss):
                stopped = "diverged"
                break
            avg = beta * avg + (1 - beta) * loss
            s = avg / (1 - beta ** (i + 1))
            smoothed.append(s)
            best = min(best, s)
            if s > diverge_factor * best:
                stopped = "diverged"
                break
        trainer.logger.close()
    return LRFindResult(
        lrs, losses, smoothed, suggest_lr(lrs[: len(smoothed)], smoothed),
        round(time.perf_counter() - t0, 3), stopped,
    )  # fmt: skip


def _endless(trainer: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        trainer.sampler.set_epoch(epoch)
        yield from trainer.train_loader
        epoch += 1


def suggest_lr(lrs: list[float], smoothed: list[float]) -> float:
    """The LR of the steepest descent of the smoothed loss, before its minimum."""
    if len(smoothed) < 3:
        raise ValueError("the sweep diverged within 3 steps: lower min_lr")
    lo = max(1, len(smoothed) // 10)  # the first points carry the EMA's start-up noise
    end = int(np.argmin(smoothed)) + 1
    if end - lo < 2:
        return lrs[end - 1] / 10
    slope = np.gradient(np.asarray(smoothed[lo:end]), np.log(np.asarray(lrs[lo:end])))
    return float(lrs[lo + int(np.argmin(slope))])


def plot(result: LRFindResult, path: Path) -> None:
    from hpc_core.plots import figure, write_png

    fig = figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    n = len(result.smoothed)
    ax.plot(result.lrs[:n], result.losses[:n], alpha=0.3, label="loss")
    ax.plot(result.lrs[:n], result.smoothed, label="smoothed")
    ax.axvline(result.suggestion, color="C3", ls="--", label=f"suggestion {result.suggestion:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("train loss")
    top = min(max(result.smoothed), 4 * min(result.smoothed))
    ax.set_ylim(top=top * 1.05)
    ax.legend()
    write_png(fig, path)


def add_lr_find_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--max-lr", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in the sweep")
    p.add_argument("--plot", default=None, help="PNG path (default: run.output_dir/lr_find.png)")


def run_lr_find(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        result = lr_range_test(cfg, min_lr=args.min_lr, max_lr=args.max_lr, steps=args.steps)
    except ValueError as e:
        print(f"lr-find: {e}", file=sys.stderr)
        return 2
    path = Path(args.plot) if args.plot else cfg.run.output_dir / "lr_find.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(result, path)
    summary = {k: v for k, v in asdict(result).items() if k not in ("lrs", "losses", "smoothed")}
    print(json.dumps({**summary, "steps": len(result.losses), "plot": str(path)}))
    return 0
