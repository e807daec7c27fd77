"""The gate metric of a base checkpoint and a candidate on the upstream held-out split: top-1
accuracy for a classifier, mAP@0.5:0.95 for a detector (the task's ``gate_metric``).

The torch half of ``hpc-train publish --max-upstream-drop``; the gate itself is
``hpc_core.aggregation.gates``, which is torch-free and gets this function handed in.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import DataLoader

from hpc_core.checkpoint import load_model
from hpc_core.config import DataConfig
from hpc_core.tasks import get_task
from hpc_core.tasks.base import Task

EVAL_BATCH = 256
"""Samples scored per forward pass: one batch of held-out images, never the whole split."""


def base_and_candidate(base: Path, candidate: Path, data: DataConfig) -> tuple[float, float, int]:
    """(base metric, candidate metric, samples) on ``data``'s validation split, the metric
    being the gate metric of the base's task; both models see the same samples in the same
    order. ``nan`` (a detection split without objects) fails every gate."""
    base_model, base_cfg = load_model(base)
    task: Task = get_task(base_cfg.task)
    _, val, _ = task.build_datasets(data)
    loader = DataLoader(val, batch_size=EVAL_BATCH, shuffle=False, collate_fn=task.collate)
    base_score = task.evaluate(base_model, loader)[task.gate_metric]
    del base_model
    cand_model, cand_cfg = load_model(candidate)
    if cand_cfg.task != base_cfg.task:
        raise ValueError(f"{candidate} is a {cand_cfg.task} model, the base {base} a "
                         f"{base_cfg.task} one: they cannot be compared")
    cand_score = task.evaluate(cand_model, loader)[task.gate_metric]
    return base_score, cand_score, len(val)  # type: ignore[arg-type]
