"""Recovery fine-tune after pruning: the project's one training loop, with the masks kept.

Pruning costs accuracy; a short fine-tune wins most of it back (and 2:4 sparsity needs one,
see NVIDIA's ASP recipe). It runs through ``hpc_core.trainer.Trainer`` like any other job;
the only addition is :class:`MaskKeeper`, a ``TrainerHook`` that zeroes the pruned weights
again after every optimizer step, so what the optimizer moves comes back to zero before the
next forward pass and before any evaluation or checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from exporters.job import RecoveryConfig
from exporters.prune import Masks
from hpc_core.config import TrainConfig, config_from_dict
from hpc_core.trainer import Trainer


class MaskKeeper:
    """TrainerHook: re-apply the pruning masks after every optimizer step."""

    def __init__(self, model: nn.Module, masks: Masks) -> None:
        params = dict(model.named_parameters())
        missing = sorted(set(masks) - set(params))
        if missing:
            raise KeyError(f"masks name parameters the model does not have: {missing[:5]}")
        self._pairs = [(params[name], mask) for name, mask in masks.items()]
        self.applied = 0

    @torch.no_grad()
    def apply(self) -> None:
        for i, (p, mask) in enumerate(self._pairs):
            if mask.device != p.device or mask.dtype != p.dtype:
                # The trainer may have moved the model to the GPU: move the mask once.
                mask = mask.to(device=p.device, dtype=p.dtype)
                self._pairs[i] = (p, mask)
            p.mul_(mask)
        self.applied += 1

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        self.apply()


@dataclass
class RecoveryResult:
    steps: int
    metrics: dict[str, float]
    """The trainer's final evaluation (eval/loss, eval/acc) of the pruned model."""
    seconds: float


def recovery_train_config(
    base: TrainConfig, cfg: RecoveryConfig, output_dir: Path, num_train: int
) -> TrainConfig:
    """The job's own data and model spec (and the memory order it trained in) with a short
    fine-tune schedule."""
    tree: dict[str, Any] = {
        "run": {"name": "export-recovery", "output_dir": str(output_dir), "seed": base.run.seed},
        "data": base.data.model_dump(mode="json"),
        "model": base.model.model_dump(mode="json"),
        "optimizer": {
            "name": "adamw",
            "lr": cfg.lr or base.optimizer.lr,
            "weight_decay": cfg.weight_decay,
        },
        "schedule": {"warmup_steps": min(10, cfg.steps // 10), "decay": "cosine"},
        "training": {
            "global_batch_size": min(cfg.batch_size, num_train),
            "max_steps": cfg.steps,
            "device": cfg.device,
            "precision": cfg.precision,
            # The memory order the model trained in: NHWC where its training found it faster.
            "channels_last": base.training.channels_last,
        },
        # The fine-tuned weights stay in memory and go straight to export: no checkpoints.
        "checkpoint": {"best_metric": None, "save_final": False},
        "logging": {"progress": "off", "log_every_steps": max(1, cfg.steps // 4)},
        # The caller (agent job or CLI) owns the signals.
        "faults": {"handle_signals": False},
    }
    return config_from_dict(tree, source="exporters.recovery")


def recover(
    model: nn.Module,
    masks: Masks,
    datasets: tuple[Dataset, Dataset],
    base: TrainConfig,
    cfg: RecoveryConfig,
    output_dir: Path,
) -> RecoveryResult:
    """Fine-tune ``model`` in place for ``cfg.steps`` steps keeping ``masks``; back on CPU."""
    t0 = time.perf_counter()
    keeper = MaskKeeper(model, masks)
    keeper.apply()
    train_cfg = recovery_train_config(base, cfg, output_dir, len(datasets[0]))  # type: ignore[arg-type]
    result = Trainer(train_cfg, model=model, datasets=datasets, hooks=[keeper]).train()
    model.cpu().eval()
    keeper.apply()
    return RecoveryResult(result.final_step, result.metrics, time.perf_counter() - t0)
