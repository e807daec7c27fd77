"""The device side of the task seam, without a job: the health and evaluate steps score
through the model's task (a classifier's figures as they were, by argmax), the health verdict
never passes an undefined (nan) metric, the job's outcome names the metric its gates
compared, and the export's quantizing half scores through the task without loading torch."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from agent.jobs.held_out import HeldOut, finite, metric_of
from agent.jobs.outcome import outcome
from agent.jobs.steps.health import health_failures
from tests.agent.jobs.conftest import REPO

OPTS = {"max_accuracy_drop_pts": 0.0, "min_accuracy": None, "max_latency_ratio": None}


def _logits(n: int = 200, k: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, k)).astype(np.float32), rng.integers(0, k, n)


def test_a_classifier_is_scored_by_top1_exactly_as_before() -> None:
    logits, y = _logits()
    figures = HeldOut("classification", np.zeros((len(y), 1, 8, 8), np.float32), y).figures(logits)
    by_hand = float((logits.argmax(1) == y).mean())
    assert figures["accuracy"] == figures["metric"] == by_hand
    assert figures["metrics"]["acc"] == by_hand and figures["metrics"]["loss"] > 0


def test_a_detector_is_scored_by_its_map_and_reports_no_top1() -> None:
    from hpc_core.tasks.detection.metrics import evaluate_detections

    boxes = np.array([[2, 2, 20, 20], [30, 30, 60, 50]], np.float32)
    truth = [{"boxes": boxes, "labels": np.array([1, 2])}]  # the model's labels: class + 1
    preds = [{"boxes": boxes + 1, "scores": np.array([0.9, 0.4], np.float32),
              "labels": np.array([1, 2])}]
    figures = HeldOut("detection", np.zeros((1, 3, 64, 64), np.float32), truth).figures(preds)
    want = evaluate_detections([{**preds[0], "labels": preds[0]["labels"] - 1}],
                               [{**truth[0], "labels": truth[0]["labels"] - 1}], ["a", "b"])
    assert figures["accuracy"] is None
    assert figures["metric"] == figures["metrics"]["map"] == pytest.approx(want.map, abs=1e-12)
    assert figures["metrics"]["map50"] == pytest.approx(want.map_50, abs=1e-12)
    # No ground truth at all: undefined, nan, kept as None among the JSON figures.
    empty = [{"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64)}]
    none = HeldOut("detection", np.zeros((1, 3, 64, 64), np.float32), empty).figures(preds)
    assert math.isnan(none["metric"]) and none["metrics"]["map"] is None


def test_finite_walks_arrays_and_per_image_dicts() -> None:
    ok = [{"boxes": np.ones((2, 4), np.float32), "labels": np.array([1, 2])}]
    assert finite(np.ones((2, 3))) and finite(ok)
    assert not finite(np.array([[0.0, np.nan]]))
    assert not finite([*ok, {"boxes": np.array([[0, 0, np.inf, 1]], np.float32)}])


def _fig(v: float | None, p50: float = 1.0) -> dict[str, Any]:
    return {"metric": v, "p50_ms_b1": p50}


def test_health_verdicts_on_the_gate_metric_and_nan_never_passes() -> None:
    assert health_failures(_fig(0.8), _fig(0.8), OPTS) == []
    drop = health_failures(_fig(0.83), _fig(0.80), OPTS)
    assert drop == ["accuracy 80.0% is 3.0 points below the active model's 83.0% "
                    "(health.max_accuracy_drop_pts=0.0)"]
    # The drop is measured in points as the threshold is given (a classifier's verdict as it
    # was: 100 * (0.91 - 0.88) is just over 3).
    assert health_failures(_fig(0.91), _fig(0.88), {**OPTS, "max_accuracy_drop_pts": 3.0})
    lines = health_failures(_fig(0.2), _fig(0.3), {**OPTS, "min_accuracy": 0.5}, "mAP@0.5:0.95")
    assert lines == ["mAP@0.5:0.95 30.0% is below health.min_accuracy=0.5"]
    for active in (0.2, float("nan")):  # whatever the active model scored, and any threshold
        nan = health_failures(_fig(active), _fig(float("nan")),
                              {**OPTS, "max_accuracy_drop_pts": 100.0}, "mAP@0.5:0.95")
        assert len(nan) == 1 and "undefined" in nan[0], nan
    assert health_failures(_fig(0.2), _fig(None), {**OPTS, "max_accuracy_drop_pts": 100.0})
    # A job recorded before the seam has accuracy only.
    assert metric_of({"accuracy": 0.5}) == 0.5 and math.isnan(metric_of({"accuracy": None}))


def _ctx(outputs: dict[str, Any]) -> Any:
    return SimpleNamespace(outputs=outputs, model_name=lambda: "m", spec=SimpleNamespace())


def test_the_outcome_names_the_gate_metric_its_figures_are() -> None:
    classifier = {"gate_metric": "acc", "active": {"accuracy": 0.5, "metric": 0.5},
                  "staged": {"accuracy": 0.7, "metric": 0.7}, "failures": []}
    res = outcome(_ctx({"health": classifier, "commit": {"version": "v2", "slot": "b"}}))
    assert res["metrics_before"] == {"eval/acc": 0.5} and res["metrics_after"] == {"eval/acc": 0.7}
    assert res["gate_metric"] == "eval/acc"
    # Recorded before the seam: top-1 under accuracy, no gate metric named.
    old = {"active": {"accuracy": 0.5}, "staged": {"accuracy": 0.7}, "failures": []}
    assert outcome(_ctx({"health": old}))["metrics_after"] == {"eval/acc": 0.7}
    detector = {"gate_metric": "map", "active": {"accuracy": None, "metric": 0.25},
                "staged": {"accuracy": None, "metric": float("nan")}, "failures": ["x"]}
    res = outcome(_ctx({"health": detector, "rollback": {"why": "x"}}))
    # nan (undefined) is no figure: the fleet's abort never reads one.
    assert res["metrics_before"] == {"eval/map": 0.25} and res["metrics_after"] == {}
    assert res["gate_metric"] == "eval/map" and res["outcome"] == "rolled_back"
    from contract import JobOutcome

    assert JobOutcome.model_validate(res).gate_metric == "eval/map"


def test_the_export_gates_score_through_the_task_without_loading_torch(tmp_path: Path) -> None:
    """The quantizing half of an export is torch-free (its memory is the job's budget): the
    task's scorer for a classifier is numpy, and it gives top-1 as argmax does."""
    code = """
import sys
import numpy as np
from exporters.gates import gate_value, top1
rng = np.random.default_rng(1)
logits, y = rng.normal(size=(50, 4)), rng.integers(0, 4, 50)
assert gate_value("classification", logits, y) == top1(logits, y) == (logits.argmax(1) == y).mean()
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_export_is_refused_for_a_task_it_cannot_export() -> None:
    from exporters.job import unexportable

    assert unexportable("classification") is None
    assert unexportable("detection", "torchvision/ssdlite320_mobilenet_v3_large") is None
    why = unexportable("detection", "torchvision/fcos_resnet18_fpn")
    assert why is not None and "steps.export: false" in why and "no ONNX export" in why
