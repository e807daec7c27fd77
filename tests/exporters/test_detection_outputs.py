"""The padded detection outputs, packed and unpacked; held-out targets through the
hand-over; the mAP@0.5 gate. Torch-free where the exporter's quantizing half is."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from exporters.detection.outputs import (
    MODEL_LABEL_OFFSET,
    PAD_CLASS,
    as_scored,
    model_detections,
    pack,
    pack_detections,
    pack_targets,
    unpack,
    unpack_targets,
)
from exporters.gates import GateMeasurement, judge
from exporters.job import GateConfig
from exporters.runtime import Latency
from tests.agent.jobs.conftest import REPO


def outputs() -> list[np.ndarray]:
    boxes = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    scores = np.array([[0.9, 0.5, 0.7], [0.8, 0.0, 0.3]], np.float32)
    classes = np.array([[1, 0, 4], [2, 9, 9]], np.int32)
    return [np.array([[2], [1]], np.int32), boxes, scores, classes]


def test_pack_keeps_the_first_num_detections_rows_and_pads_the_rest() -> None:
    packed = pack(outputs())
    assert packed.shape == (2, 3, 6) and packed.dtype == np.float32
    dets = unpack(packed)
    assert [len(d["scores"]) for d in dets] == [2, 1]  # not the row past num_detections
    np.testing.assert_array_equal(dets[0]["labels"], [1, 0])
    np.testing.assert_array_equal(dets[1]["boxes"], outputs()[1][1, :1])
    assert (packed[0, 2, :5] == 0).all() and packed[0, 2, 5] == PAD_CLASS
    # what a runtime gives the health check: torchvision's labels, background offset on
    np.testing.assert_array_equal(model_detections(outputs())[0]["labels"], [2, 1])
    # the PyTorch detector's own per-image output packs the same way
    again = pack_detections([{"boxes": d["boxes"], "scores": d["scores"],
                              "labels": d["labels"] + 1} for d in dets], 3, 1)
    np.testing.assert_array_equal(again, packed)


def test_targets_survive_the_hand_over_with_images_that_hold_none() -> None:
    targets = [{"boxes": np.array([[1, 2, 3, 4]], np.float32), "labels": np.array([3])},
               {"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64)},
               {"boxes": np.array([[0, 0, 5, 5], [1, 1, 2, 2]], np.float32),
                "labels": np.array([1, 2]), "iscrowd": np.array([0, 1])}]
    rows = pack_targets(targets, label_offset=1)
    back = unpack_targets(rows, 3)
    assert [len(t["labels"]) for t in back] == [1, 0, 2]
    np.testing.assert_array_equal(back[0]["labels"], [2])
    np.testing.assert_array_equal(back[2]["iscrowd"], [0, 1])
    np.testing.assert_array_equal(back[2]["boxes"], targets[2]["boxes"])
    preds, truth = as_scored(np.zeros((3, 2, 6), np.float32) - 1, rows)
    assert [len(p["labels"]) for p in preds] == [0, 0, 0]
    np.testing.assert_array_equal(truth[0]["labels"], [3])  # the scorer's convention again


def test_the_label_offset_is_the_detection_tasks() -> None:
    from hpc_core.tasks.detection.sources import LABEL_OFFSET

    assert MODEL_LABEL_OFFSET == LABEL_OFFSET


def test_the_outputs_module_and_the_runner_stay_torch_free() -> None:
    code = ("import sys, exporters.detection.outputs, exporters.ort_runner, exporters.gates; "
            "assert 'torch' not in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def measurement(**over: float) -> GateMeasurement:
    base = {"top1": 0.30, "reference_top1": 0.31, "top1_drop_pts": 1.0,
            "max_abs_logit_delta": math.nan, "latency_b1": Latency(1, 1.0, 2.0, 5),
            "latency_batch": Latency(8, 4.0, 6.0, 5), "size_mb": 1.0, "samples": 8,
            "gate_metric": "map", "map50": 0.6, "reference_map50": 0.61,
            "map50_drop_pts": 1.0}
    return GateMeasurement(**{**base, **over})  # type: ignore[arg-type]


@pytest.mark.parametrize(("drop", "passed"), [(1.0, True), (1.01, False), (math.nan, False)])
def test_the_map50_gate_is_inclusive_and_nan_fails(drop: float, passed: bool) -> None:
    result = judge(measurement(map50_drop_pts=drop), GateConfig())
    assert result.passed is passed
    if not passed:
        assert result.failures == [
            f"mAP@0.5 drop {drop:.4g}pts > 1pts (gates.max_map50_drop_pts)"]
    # the gate metric's own drop is named by its metric; no logit gate unless set
    failed = judge(measurement(top1_drop_pts=2.0), GateConfig()).failures
    assert failed == ["map drop 2pts > 1pts (gates.max_top1_drop_pts)"]
    assert judge(measurement(map50_drop_pts=9.0),
                 GateConfig(max_map50_drop_pts=None)).passed
