"""COCO's metric through pycocotools, on cases whose answer is worked out by hand here.

How COCOeval scores one class (what the expected numbers below follow): detections are
ranked by score and greedily matched to unmatched ground truth at IoU >= t, for each of the
ten thresholds t = 0.50, 0.55, ..., 0.95. Precision is made monotone (each point takes the
best precision at any higher recall) and read at the 101 recall points 0, 0.01, ..., 1.00; a
point beyond the highest recall reached counts 0. AP is the mean of those 101 values, mAP the
mean over thresholds and classes.
"""

from __future__ import annotations

import math

import pytest
import torch

from hpc_core.tasks.detection.metrics import evaluate_detections


def _t(boxes: list[list[float]], labels: list[int], **extra: list) -> dict[str, torch.Tensor]:
    out = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
           "labels": torch.tensor(labels, dtype=torch.int64)}
    out.update({k: torch.tensor(v) for k, v in extra.items()})
    return out


def _p(boxes: list[list[float]], labels: list[int], scores: list[float]) -> dict:
    return _t(boxes, labels, scores=[float(s) for s in scores])


BOX = [0.0, 0.0, 10.0, 10.0]


def test_one_perfect_box_scores_one_everywhere() -> None:
    m = evaluate_detections([_p([BOX], [0], [0.9])], [_t([BOX], [0])], ["a"])
    assert m.map == pytest.approx(1.0) and m.map_50 == pytest.approx(1.0)
    assert m.map_75 == pytest.approx(1.0) and m.ar_100 == pytest.approx(1.0)
    assert m.per_class_ap == {"a": pytest.approx(1.0)}


def test_a_box_at_iou_062_counts_at_three_of_ten_thresholds() -> None:
    # prediction [0,0,10,6.2] inside the 10x10 ground truth: IoU = 62 / 100 = 0.62, a hit at
    # t = 0.50, 0.55, 0.60 (AP 1 each: one hit, no false positive) and a miss at the seven
    # thresholds 0.65 .. 0.95 (AP 0): mAP = 3 / 10 = 0.3, AP50 = 1, AP75 = 0; recall likewise
    # 1 at three thresholds, 0 at seven: AR@100 = 0.3
    m = evaluate_detections([_p([[0, 0, 10, 6.2]], [0], [0.9])], [_t([BOX], [0])], ["a"])
    assert m.map == pytest.approx(0.3)
    assert m.map_50 == pytest.approx(1.0) and m.map_75 == pytest.approx(0.0)
    assert m.ar_100 == pytest.approx(0.3)


def test_a_miss_and_a_false_positive_follow_the_101_point_rule() -> None:
    gt = [_t([BOX, [50, 50, 60, 60]], [0, 0])]
    # ranked: the hit (0.9) then a false positive (0.8). After the hit precision 1 at recall
    # 0.5; the second ground truth is never found. The 51 recall points 0.00 .. 0.50 read 1,
    # the 50 points 0.51 .. 1.00 read 0: AP = 51 / 101 at every threshold.
    hit_first = [_p([BOX, [80, 80, 90, 90]], [0, 0], [0.9, 0.8])]
    m = evaluate_detections(hit_first, gt, ["a"])
    assert m.map == pytest.approx(51 / 101) and m.map_50 == pytest.approx(51 / 101)
    assert m.ar_100 == pytest.approx(0.5)
    # the false positive ranked first: precision is 0 at rank 1 and 1/2 at rank 2 (recall
    # 0.5); made monotone, the 51 points up to recall 0.5 read 1/2: AP = 0.5 * 51 / 101
    fp_first = [_p([BOX, [80, 80, 90, 90]], [0, 0], [0.8, 0.9])]
    m = evaluate_detections(fp_first, gt, ["a"])
    assert m.map == pytest.approx(0.5 * 51 / 101)


def test_mean_over_classes_and_per_class_ap() -> None:
    # class a found exactly (AP 1), class b has ground truth and no prediction (AP 0),
    # class c has neither (undefined: nan, left out of the mean): mAP = (1 + 0) / 2
    targets = [_t([BOX, [20, 20, 40, 40]], [0, 1])]
    m = evaluate_detections([_p([BOX], [0], [0.9])], targets, ["a", "b", "c"])
    assert m.per_class_ap["a"] == pytest.approx(1.0)
    assert m.per_class_ap["b"] == pytest.approx(0.0)
    assert math.isnan(m.per_class_ap["c"])
    assert m.map == pytest.approx(0.5)
    assert m.as_dict()["ap/b"] == pytest.approx(0.0)


def test_predictions_of_a_class_without_ground_truth_leave_the_mean_alone() -> None:
    # a confident box of class b where only class a exists: b has no ground truth, so COCO
    # gives it no AP and the mean is a's alone
    preds = [_p([BOX, [50, 50, 70, 70]], [0, 1], [0.9, 0.99])]
    m = evaluate_detections(preds, [_t([BOX], [0])], ["a", "b"])
    assert m.map == pytest.approx(1.0) and math.isnan(m.per_class_ap["b"])


def test_no_predictions_score_zero_and_no_ground_truth_is_undefined() -> None:
    empty = _p([], [], [])
    m = evaluate_detections([empty], [_t([BOX], [0])], ["a"])
    assert m.map == 0.0 and m.map_50 == 0.0 and m.ar_100 == 0.0
    none = evaluate_detections([empty], [_t([], [])], ["a"])
    assert math.isnan(none.map) and math.isnan(none.per_class_ap["a"])


def test_empty_images_change_nothing_and_detections_on_them_are_false_positives() -> None:
    gt = [_t([BOX], [0]), _t([], [])]
    m = evaluate_detections([_p([BOX], [0], [0.9]), _p([], [], [])], gt, ["a"])
    assert m.map == pytest.approx(1.0)
    # a more confident box on the empty image ranks first and is false: AP = 0.5 (precision
    # 1/2 at recall 1, made monotone over all 101 points)
    m = evaluate_detections([_p([BOX], [0], [0.9]), _p([BOX], [0], [0.95])], gt, ["a"])
    assert m.map == pytest.approx(0.5)


def test_a_detection_on_a_crowd_region_is_neither_hit_nor_false_positive() -> None:
    crowd = [60.0, 60.0, 90.0, 90.0]
    preds = [_p([BOX, crowd], [0, 0], [0.9, 0.95])]
    with_crowd = [_t([BOX, crowd], [0, 0], iscrowd=[0, 1])]
    assert evaluate_detections(preds, with_crowd, ["a"]).map == pytest.approx(1.0)
    # without the crowd region the same detection is a false positive ranked first: AP 0.5
    without = [_t([BOX], [0])]
    assert evaluate_detections(preds, without, ["a"]).map == pytest.approx(0.5)


def test_pycocotools_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    evaluate_detections([_p([BOX], [0], [0.9])], [_t([BOX], [0])], ["a"])
    assert capsys.readouterr().out == ""


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="label 3 is not a class index"):
        evaluate_detections([_p([BOX], [3], [0.9])], [_t([BOX], [0])], ["a"])
    with pytest.raises(ValueError, match="1 predictions for 2 images"):
        evaluate_detections([_p([], [], [])], [_t([], []), _t([], [])], ["a"])
