"""Run a model and time it: torch eager here, ONNX Runtime in ``exporters.ort_runner``.

A runner maps a float32 NCHW batch to float32 logits, or (a model whose eval-mode output is a
list, e.g. a torchvision detector's per-image ``{"boxes", "scores", "labels"}``) to a list of
numpy dicts, one per sample. TensorRT engines have their own runner in
``exporters.tensorrt_build`` (it needs a GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from torch import nn


class Runner(Protocol):
    name: str

    def __call__(self, x: np.ndarray) -> np.ndarray: ...


class TorchRunner:
    """Eager PyTorch on CPU, the FP32 reference. torch is imported by whoever built the model;
    this module stays importable without it (the quantizing half of an export)."""

    def __init__(self, model: nn.Module, name: str = "torch") -> None:
        self.model = model.eval()
        self.name = name

    def __call__(self, x: np.ndarray) -> Any:
        import torch

        with torch.no_grad():
            out = self.model(torch.from_numpy(x))
        if isinstance(out, torch.Tensor):
            return out.float().numpy()
        # one dict of tensors per sample (a detector): float32 values, integer labels kept
        return [{k: (v.float() if v.is_floating_point() else v).numpy() for k, v in o.items()}
                for o in out]


def predict(runner: Callable[[np.ndarray], Any], x: np.ndarray, batch: int = 256) -> Any:
    """The outputs for all of ``x``, in batches: one array (logits), or one list when the
    runner gives a list of per-sample outputs."""
    parts = [runner(x[i : i + batch]) for i in range(0, len(x), batch)]
    if parts and isinstance(parts[0], list):
        return [o for part in parts for o in part]
    return np.concatenate(parts)


@dataclass
class Latency:
    batch: int
    p50_ms: float
    p99_ms: float
    iters: int


def measure_latency(
    runner: Callable[[np.ndarray], np.ndarray],
    x: np.ndarray,
    *,
    warmup: int = 5,
    iters: int = 50,
) -> Latency:
    """Wall-clock latency percentiles of one call on the batch ``x``."""
    for _ in range(warmup):
        runner(x)
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        runner(x)
        times[i] = time.perf_counter() - t0
    return Latency(
        batch=len(x),
        p50_ms=float(np.percentile(times, 50) * 1e3),
        p99_ms=float(np.percentile(times, 99) * 1e3),
        iters=iters,
    )


def batch_of(x: np.ndarray, batch: int) -> np.ndarray:
    """``batch`` samples from ``x``, repeating it if it is smaller."""
    reps = -(-batch // len(x))
    return np.ascontiguousarray(np.concatenate([x] * reps)[:batch])
