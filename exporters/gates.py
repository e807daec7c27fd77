"""Accuracy and latency gates, measured on the exported artefact itself.

INT8 problems show up in the built artefact, not in the PyTorch model, so every number here
comes from running the exported file (ONNX Runtime session or TensorRT engine) on the job's
held-out split and comparing it with the FP32 PyTorch reference:

- the drop of the model's task's gate metric (``hpc_core.tasks.score``: top-1 accuracy for
  a classifier, mAP@0.5:0.95 for a detector), in points, against the model as it came in
  (before pruning): the whole pipeline's cost; for a detector also the drop of mAP@0.5
  (``gates.max_map50_drop_pts``), scored by the same COCO evaluation;
- max |delta logit| against the PyTorch model that was exported (after pruning and
  recovery): the fidelity of export and quantization alone (a classifier's; a detector's
  outputs are boxes after NMS, ``nan`` here);
- latency p50/p99 at batch 1 and at the job's batch; file size.

A threshold left at null is not gated (its value is still measured and reported).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from exporters.detection.outputs import as_scored
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
    (``acc``: top-1 accuracy, ``map``: mAP@0.5:0.95)."""
    map50: float | None = None
    """A detector's mAP@0.5 (0-1), beside its gate metric; None for a classifier."""
    reference_map50: float | None = None
    map50_drop_pts: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class GateResult:
    passed: bool
    failures: list[str]
    """One line per failed gate: measured value, threshold and the option that sets it."""
    measurement: GateMeasurement


SCORED_FORMS: dict[str, Callable[[np.ndarray, np.ndarray], tuple[object, object]]] = {
    "detection": as_scored,
}
"""How an exported model's outputs and the hand-over's targets become what the task's scorer
takes, where they differ (a detector's padded detections and packed ground-truth rows)."""


def gate_scores(task: str, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Every metric of task ``task``'s scorer for ``outputs`` against ``labels`` (torch-free
    for a classifier: the quantizing half of an export loads torch only to score a
    detector, whose COCO evaluation lives with its task)."""
    form = SCORED_FORMS.get(task)
    predictions, targets = form(outputs, labels) if form else (outputs, labels)
    return score(task, predictions, targets)


def gate_value(task: str, outputs: np.ndarray, labels: np.ndarray) -> float:
    """Task ``task``'s gate metric of ``outputs`` against ``labels``."""
    return gate_scores(task, outputs, labels)[task_spec(task).gate_metric]


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
    metric = task_spec(task).gate_metric
    got, ref = gate_scores(task, logits, labels), gate_scores(task, reference_logits, labels)
    acc, ref_acc = got[metric], ref[metric]
    fidelity = (float(np.abs(logits - fidelity_logits).max()) if task not in SCORED_FORMS
                else float("nan"))
    map50 = {}
    if "map50" in got:
        map50 = {"map50": got["map50"], "reference_map50": ref["map50"],
                 "map50_drop_pts": (ref["map50"] - got["map50"]) * 100.0}
    b1 = measure_latency(runner, inputs[:1], warmup=cfg.latency_warmup, iters=cfg.latency_iters)
    bn = measure_latency(
        runner, batch_of(inputs, cfg.batch_size), warmup=cfg.latency_warmup,
        iters=cfg.latency_iters,
    )
    return GateMeasurement(
        top1=acc,
        reference_top1=ref_acc,
        top1_drop_pts=(ref_acc - acc) * 100.0,
        max_abs_logit_delta=fidelity,
        latency_b1=b1,
        latency_batch=bn,
        size_mb=size_bytes / 1e6,
        samples=len(inputs),
        gate_metric=metric,
        **map50,
    )


def judge(m: GateMeasurement, cfg: GateConfig) -> GateResult:
    """Pass or fail the artefact: it passes when every threshold set in ``cfg`` holds (gate
    metric drop, a detector's mAP@0.5 drop, logit fidelity, latency p50/p99 at batch 1 and
    at the job's batch, size), each measured value at most its limit; a threshold left at
    null is not gated, a measured ``nan`` fails. Each failure names the value, the limit and
    the option."""
    drop = "top-1 drop" if m.gate_metric == "acc" else f"{m.gate_metric} drop"
    checks = [
        (drop, m.top1_drop_pts, cfg.max_top1_drop_pts, "pts", "max_top1_drop_pts"),
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
    if m.map50_drop_pts is not None:
        checks.insert(1, ("mAP@0.5 drop", m.map50_drop_pts, cfg.max_map50_drop_pts, "pts",
                          "max_map50_drop_pts"))
    failures = [
        f"{what} {value:.4g}{unit} > {limit:g}{unit} (gates.{field})"
        for what, value, limit, unit, field in checks
        if limit is not None and not value <= limit  # nan (no mAP) fails too
    ]
    return GateResult(passed=not failures, failures=failures, measurement=m)
