"""Accuracy and latency gates, measured on the exported artefact itself.

INT8 problems show up in the built artefact, not in the PyTorch model, so every number here
comes from running the exported file (ONNX Runtime session or TensorRT engine) on the job's
held-out split and comparing it with the FP32 PyTorch reference:

- the drop of the model's task's gate metric (``hpc_core.tasks.score``: top-1 accuracy for
  the classifiers exported today), in points, against the model as it came in (before
  pruning): the whole pipeline's cost;
- max |delta logit| against the PyTorch model that was exported (after pruning and
  recovery): the fidelity of export and quantization alone;
- latency p50/p99 at batch 1 and at the job's batch; file size.

A threshold left at null is not gated (its value is still measured and reported).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from exporters.job import GateConfig
from exporters.runtime import Latency, batch_of, measure_latency, predict
from hpc_core.tasks import score, task_spec


@dataclass
class GateMeasurement:
    top1: float
    """The artefact's gate metric on the held-out split (0-1): its task's (``gate_metric``),
    top-1 accuracy for a classifier."""
    reference_top1: float
    top1_drop_pts: float
    max_abs_logit_delta: float
    latency_b1: Latency
    latency_batch: Latency
    size_mb: float
    samples: int
    gate_metric: str = "acc"
    """Which metric ``top1`` and its reference are: the key of the model's task's evaluation
    (``acc``: top-1 accuracy)."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class GateResult:
    passed: bool
    failures: list[str]
    """One line per failed gate: measured value, threshold and the option that sets it."""
    measurement: GateMeasurement


def gate_value(task: str, outputs: np.ndarray, labels: np.ndarray) -> float:
    """Task ``task``'s gate metric of ``outputs`` against ``labels`` (torch-free for a
    classifier: the quantizing half of an export never loads torch)."""
    return score(task, outputs, labels)[task_spec(task).gate_metric]


def top1(logits: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy: a classifier's gate metric."""
    return gate_value("classification", logits, labels)


def measure(
    runner: Callable[[np.ndarray], np.ndarray],
    *,
    inputs: np.ndarray,
    labels: np.ndarray,
    reference_logits: np.ndarray,
    fidelity_logits: np.ndarray,
    size_bytes: int,
    cfg: GateConfig,
    task: str = "classification",
) -> GateMeasurement:
    """Score and time ``runner`` on the held-out ``inputs``, by the gate metric of the
    model's ``task``.

    ``reference_logits``: the FP32 model as it came in; ``fidelity_logits``: the FP32 PyTorch
    model that was exported.
    """
    # Scored in batches of the job's batch: a TensorRT engine's profile may stop there.
    logits = predict(runner, inputs, batch=cfg.batch_size)
    acc = gate_value(task, logits, labels)
    ref_acc = gate_value(task, reference_logits, labels)
    b1 = measure_latency(runner, inputs[:1], warmup=cfg.latency_warmup, iters=cfg.latency_iters)
    bn = measure_latency(
        runner, batch_of(inputs, cfg.batch_size), warmup=cfg.latency_warmup,
        iters=cfg.latency_iters,
    )
    return GateMeasurement(
        top1=acc,
        reference_top1=ref_acc,
        top1_drop_pts=(ref_acc - acc) * 100.0,
        max_abs_logit_delta=float(np.abs(logits - fidelity_logits).max()),
        latency_b1=b1,
        latency_batch=bn,
        size_mb=size_bytes / 1e6,
        samples=len(labels),
        gate_metric=task_spec(task).gate_metric,
    )


def judge(m: GateMeasurement, cfg: GateConfig) -> GateResult:
    """Pass or fail the artefact: it passes when every threshold set in ``cfg`` holds (top-1
    drop, logit fidelity, latency p50/p99 at batch 1 and at the job's batch, size), each
    measured value at most its limit; a threshold left at null is not gated. Each failure
    names the value, the limit and the option."""
    checks = [
        ("top-1 drop", m.top1_drop_pts, cfg.max_top1_drop_pts, "pts", "max_top1_drop_pts"),
        ("max |delta logit|", m.max_abs_logit_delta, cfg.max_abs_logit_delta, "",
         "max_abs_logit_delta"),
        ("p50 latency at batch 1", m.latency_b1.p50_ms, cfg.max_p50_ms_b1, "ms", "max_p50_ms_b1"),
        ("p99 latency at batch 1", m.latency_b1.p99_ms, cfg.max_p99_ms_b1, "ms", "max_p99_ms_b1"),
        (f"p50 latency at batch {m.latency_batch.batch}", m.latency_batch.p50_ms,
         cfg.max_p50_ms_batch, "ms", "max_p50_ms_batch"),
        (f"p99 latency at batch {m.latency_batch.batch}", m.latency_batch.p99_ms,
         cfg.max_p99_ms_batch, "ms", "max_p99_ms_batch"),
        ("size", m.size_mb, cfg.max_size_mb, "MB", "max_size_mb"),
    ]
    failures = [
        f"{what} {value:.4g}{unit} > {limit:g}{unit} (gates.{field})"
        for what, value, limit, unit, field in checks
        if limit is not None and value > limit
    ]
    return GateResult(passed=not failures, failures=failures, measurement=m)
