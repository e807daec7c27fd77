"""Run a model the way it will be served, and time it: torch eager or ONNX Runtime.

A runner maps a float32 NCHW batch to float32 logits. TensorRT engines have their own runner
in ``exporters.tensorrt_build`` (it needs a GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort
import torch
from torch import nn


class Runner(Protocol):
    name: str

    def __call__(self, x: np.ndarray) -> np.ndarray: ...


class TorchRunner:
    """Eager PyTorch on CPU, the FP32 reference."""

    def __init__(self, model: nn.Module, name: str = "torch") -> None:
        self.model = model.eval()
        self.name = name

    @torch.no_grad()
    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.model(torch.from_numpy(x)).float().numpy()


class OrtRunner:
    """An ONNX Runtime session on the CPU (or the providers given)."""

    def __init__(
        self,
        path: Path,
        *,
        threads: int = 0,
        providers: list[str] | None = None,
        name: str = "onnxruntime",
    ) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads  # 0 = ONNX Runtime's default (all cores)
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            str(path), opts, providers=providers or ["CPUExecutionProvider"]
        )
        self.input_name = self.session.get_inputs()[0].name
        self.name = name

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: x})[0]


def predict(
    runner: Callable[[np.ndarray], np.ndarray], x: np.ndarray, batch: int = 256
) -> np.ndarray:
    """Logits for all of ``x``, in batches."""
    return np.concatenate([runner(x[i : i + batch]) for i in range(0, len(x), batch)])


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
