"""COCO's detection metric, computed by pycocotools' ``COCOeval`` (no AP written here).

Predictions are ``{"boxes": (N, 4) xyxy, "scores": (N,), "labels": (N,)}`` per image, targets
``{"boxes", "labels"}`` with an optional ``"iscrowd"`` (the ``Dataset``'s convention), labels
being class indices ``0 .. K-1``. Reported: mAP@[0.5:0.95] (COCO's headline number, the gate's
scalar), mAP@0.5, mAP@0.75, AR@100 and the AP@[0.5:0.95] of each class.

Undefined values are ``nan``, as pycocotools' -1: a class without ground truth has no AP, and
with no ground truth at all no mean either. A class with ground truth but no predictions has
AP 0.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hpc_core.tasks.detection.boxes import xyxy_to_coco

Detections = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DetectionMetrics:
    """What :func:`evaluate_detections` reports; ``nan`` where undefined."""

    map: float
    """AP averaged over IoU thresholds 0.50:0.05:0.95 and classes (COCO's mAP)."""
    map_50: float
    """AP at IoU 0.5 (PASCAL VOC's threshold), averaged over classes."""
    map_75: float
    ar_100: float
    """Recall with at most 100 detections per image, averaged over IoU thresholds and classes."""
    per_class_ap: dict[str, float]
    """AP@[0.5:0.95] of each class, by name."""

    def as_dict(self) -> dict[str, float]:
        return {"map": self.map, "map_50": self.map_50, "map_75": self.map_75,
                "ar_100": self.ar_100,
                **{f"ap/{k}": v for k, v in self.per_class_ap.items()}}


def _numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _undefined_as_nan(x: float) -> float:
    return math.nan if x < 0 else float(x)


def _coco_objects(targets: Sequence[Detections], predictions: Sequence[Detections] | None,
                  num_classes: int) -> dict:
    anns = []
    for image_id, t in enumerate(targets if predictions is None else predictions, start=1):
        boxes = xyxy_to_coco(_numpy(t["boxes"]))
        labels = _numpy(t["labels"]).astype(np.int64).reshape(-1)
        crowd = (_numpy(t["iscrowd"]).astype(np.int64).reshape(-1) if "iscrowd" in t
                 else np.zeros(len(labels), dtype=np.int64))
        scores = _numpy(t["scores"]).reshape(-1) if predictions is not None else None
        for j, (box, label) in enumerate(zip(boxes, labels, strict=True)):
            if not 0 <= label < num_classes:
                raise ValueError(f"image {image_id - 1}: label {label} is not a class index "
                                 f"0 .. {num_classes - 1}")
            # ids from 1: COCOeval takes an id of 0 for "unmatched"
            ann = {"id": len(anns) + 1, "image_id": image_id, "category_id": int(label) + 1,
                   "bbox": [float(v) for v in box], "area": float(box[2] * box[3]),
                   "iscrowd": 0 if scores is not None else int(crowd[j])}
            if scores is not None:
                ann["score"] = float(scores[j])
            anns.append(ann)
    return {"images": [{"id": i} for i in range(1, len(targets) + 1)],
            "categories": [{"id": k + 1, "name": str(k)} for k in range(num_classes)],
            "annotations": anns}


def evaluate_detections(
    predictions: Sequence[Detections], targets: Sequence[Detections],
    class_names: Sequence[str],
) -> DetectionMetrics:
    """COCO's bbox metrics of ``predictions`` against ``targets`` (one entry per image, same
    order) over the classes ``class_names``. pycocotools' printing is captured."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} images")
    k = len(class_names)
    with contextlib.redirect_stdout(io.StringIO()):
        gt, dt = COCO(), COCO()
        # built as objects rather than through loadRes, which fails on an empty result list
        gt.dataset = _coco_objects(targets, None, k)
        dt.dataset = _coco_objects(targets, predictions, k)
        gt.createIndex()
        dt.createIndex()
        ev = COCOeval(gt, dt, iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = [_undefined_as_nan(s) for s in ev.stats]
    # precision: [IoU threshold, recall point, class, area range, max detections]; area "all"
    # (0) at 100 detections (-1), as stats[0] reads it, per class
    precision = ev.eval["precision"][:, :, :, 0, -1]
    per_class = {}
    for c, name in enumerate(class_names):
        p = precision[:, :, c]
        per_class[name] = float(p[p > -1].mean()) if (p > -1).any() else math.nan
    return DetectionMetrics(map=stats[0], map_50=stats[1], map_75=stats[2], ar_100=stats[8],
                            per_class_ap=per_class)
