"""Top-1 accuracy of a base checkpoint and a candidate on the upstream held-out split.

The torch half of ``hpc-train publish --max-upstream-drop``; the gate itself is
``hpc_core.aggregation.gates``, which is torch-free and gets this function handed in.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hpc_core.checkpoint import load_model
from hpc_core.config import DataConfig
from hpc_core.data import build_datasets

EVAL_BATCH = 256
"""Samples scored per forward pass: one batch of held-out images, never the whole split."""


def _accuracy(checkpoint: Path, loader: DataLoader) -> float:
    model, _ = load_model(checkpoint)
    model.eval()
    correct, count = 0, 0
    with torch.inference_mode():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
            count += len(y)
    return correct / count


def base_and_candidate(base: Path, candidate: Path, data: DataConfig) -> tuple[float, float, int]:
    """(base accuracy, candidate accuracy, samples) on ``data``'s validation split; both
    models see the same samples in the same order."""
    _, val, _ = build_datasets(data)
    loader = DataLoader(val, batch_size=EVAL_BATCH, shuffle=False)
    return _accuracy(base, loader), _accuracy(candidate, loader), len(val)  # type: ignore[arg-type]
