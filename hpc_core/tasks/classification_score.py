"""Classification's metrics of logits made outside torch (an ONNX Runtime session, a TensorRT
engine, numpy): numpy only, so the torch-free half of an export scores its artefacts through
the task (``hpc_core.tasks.score``) without loading torch."""

from __future__ import annotations

from typing import Any

import numpy as np


def score_logits(predictions: Any, targets: Any) -> dict[str, float]:
    """Cross-entropy and top-1 of logits ``(N, C)`` against labels ``(N,)`` (numpy or
    anything ``np.asarray`` takes), in float64; both ``nan`` with no sample."""
    logits = np.asarray(predictions, dtype=np.float64)
    labels = np.asarray(targets).astype(np.int64).reshape(-1)
    if logits.ndim != 2 or len(logits) != len(labels):
        raise ValueError(f"expected logits (N, C) and labels (N,), got {logits.shape} and "
                         f"{labels.shape}")
    if len(labels) == 0:
        return {"loss": float("nan"), "acc": float("nan")}
    top = logits.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite logits: a nan loss
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    loss = float(np.mean(log_z - logits[np.arange(len(labels)), labels]))
    return {"loss": loss, "acc": float(np.mean(logits.argmax(axis=1) == labels))}
