"""Object detection: a torchvision detector's losses, its detections, COCO's mAP.

A batch is two lists (:func:`~.dataset.collate`): images ``3xHxW`` and targets
``{"boxes", "labels"}``; micro-batches slice the lists. In train mode a torchvision detector
returns its loss dict (classification, box regression, ...): the loss is their sum, each
already a mean over the batch as torchvision normalises it. In eval mode it returns one
``{"boxes", "scores", "labels"}`` per image, which the evaluation scores with pycocotools
(:func:`~.metrics.evaluate_detections`): ``map`` (mAP@0.5:0.95, the gate's metric),
``map50``, ``map75`` and ``ar100``; ``nan`` when undefined (no ground truth).

Micro-batches: RetinaNet normalises its losses per image, so accumulated micro-batches give
the full batch's gradient; SSD and FCOS divide by the batch's count of matched objects, so
there each micro-batch is normalised by its own count (the same expectation, not the same
number).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

import numpy as np
import torch
import torch.distributed
from torch import nn
from torch.utils.data import Dataset

from hpc_core.cameras import KINDS
from hpc_core.config import DataConfig
from hpc_core.data import DataInfo
from hpc_core.distributed import DistInfo
from hpc_core.tasks import TASKS
from hpc_core.tasks.base import Autocast, Evaluation, Task, no_autocast
from hpc_core.tasks.detection.dataset import collate
from hpc_core.tasks.detection.metrics import evaluate_detections
from hpc_core.tasks.detection.sources import LABEL_OFFSET, build_detection_datasets
from hpc_core.tasks.detection.synthetic import CLASS_NAMES
from hpc_core.tasks.detection.synthetic_config import CameraKind, SyntheticClass

assert set(get_args(CameraKind)) == set(KINDS), (
    "synthetic_config.CameraKind and hpc_core.cameras differ")
assert list(get_args(SyntheticClass)) == CLASS_NAMES, (
    "synthetic_config.SyntheticClass and the synthetic set's CLASS_NAMES differ")

NumpyDetections = dict[str, np.ndarray]

PREDICTION_KEYS = ("boxes", "scores", "labels")
TARGET_KEYS = ("boxes", "labels", "iscrowd")


def _numpy(d: dict[str, Any], keys: Sequence[str]) -> NumpyDetections:
    return {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v))
            for k, v in d.items() if k in keys}


def score_detections(predictions: Sequence[dict[str, Any]],
                     targets: Sequence[dict[str, Any]]) -> dict[str, float]:
    """COCO's metrics of per-image predictions against targets, labels as the model and its
    data sets give them (shifted by :data:`LABEL_OFFSET`). The classes are those seen in the
    targets or the predictions: a class no image holds has no AP and leaves the mean alone."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} images")
    nan = float("nan")
    if not targets:
        return {"map": nan, "map50": nan, "map75": nan, "ar100": nan}
    preds, truths = [], []
    for p, t in zip(predictions, targets, strict=True):
        p, t = _numpy(p, PREDICTION_KEYS), _numpy(t, TARGET_KEYS)
        keep = p["labels"].reshape(-1) >= LABEL_OFFSET  # background is never a detection
        preds.append({"boxes": p["boxes"].reshape(-1, 4)[keep], "scores":
                      p["scores"].reshape(-1)[keep], "labels": p["labels"].reshape(-1)[keep]
                      - LABEL_OFFSET})
        truths.append({**t, "labels": t["labels"].reshape(-1) - LABEL_OFFSET})
    labels = [d["labels"] for d in (*preds, *truths) if len(d["labels"])]
    num_classes = int(max(int(x.max()) for x in labels)) + 1 if labels else 1
    m = evaluate_detections(preds, truths, [str(k) for k in range(num_classes)])
    return {"map": m.map, "map50": m.map_50, "map75": m.map_75, "ar100": m.ar_100}


class DetectionEvaluation(Evaluation):
    """Keeps this rank's detections and targets (on the CPU, as numpy); under DDP the ranks
    exchange them (``all_gather_object``) and every rank scores the whole set."""

    def __init__(self, dist: DistInfo | None) -> None:
        self.dist = dist
        self.predictions: list[NumpyDetections] = []
        self.targets: list[NumpyDetections] = []

    def add(self, outputs: Sequence[dict[str, torch.Tensor]],
            targets: Sequence[dict[str, torch.Tensor]]) -> None:
        if len(outputs) != len(targets):
            raise ValueError(f"{len(outputs)} outputs for {len(targets)} targets")
        self.predictions += [_numpy(o, PREDICTION_KEYS) for o in outputs]
        self.targets += [_numpy(t, TARGET_KEYS) for t in targets]

    def result(self) -> dict[str, float]:
        predictions, targets = self.predictions, self.targets
        if self.dist is not None and self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, (predictions, targets))
            predictions = [p for rank_preds, _ in gathered for p in rank_preds]
            targets = [t for _, rank_targets in gathered for t in rank_targets]
        return score_detections(predictions, targets)


class DetectionTask(Task):
    spec = TASKS["detection"]

    def build_datasets(self, cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
        return build_detection_datasets(cfg)

    def infer_info(self, train: Dataset, val: Dataset, num_classes: int | None) -> DataInfo:
        n_train, n_val = len(train), len(val)  # type: ignore[arg-type]
        image, _ = train[0]
        if num_classes is None:
            # a DetectionDataset gives its targets without loading the images
            target = getattr(train, "target", lambda i: train[i][1])
            labels = [int(t["labels"].max()) for t in map(target, range(n_train))
                      if len(t["labels"])]
            if not labels:
                raise ValueError("the training set holds no object: set model.num_classes")
            num_classes = max(labels) + 1
        return DataInfo(num_classes, int(image.shape[0]), int(max(image.shape[-2:])), n_train,
                        n_val)

    def collate(self, batch: list[Any]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        return collate(batch)

    def split(self, inputs: Any, targets: Any, start: int, stop: int) -> tuple[Any, Any]:
        return list(inputs[start:stop]), list(targets[start:stop])

    def to_device(self, inputs: Sequence[torch.Tensor], targets: Sequence[dict[str, Any]],
                  device: torch.device) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        return ([im.to(device, non_blocking=True) for im in inputs],
                [{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                  for k, v in t.items()} for t in targets])

    def loss(self, model: nn.Module, inputs: Sequence[torch.Tensor],
             targets: Sequence[dict[str, torch.Tensor]],
             autocast: Autocast = no_autocast) -> torch.Tensor:
        with autocast():
            losses = model(list(inputs), list(targets))
        if not isinstance(losses, dict):
            raise TypeError(f"the detector returned {type(losses).__name__} in train mode, not "
                            "its loss dict: is it a torchvision detector?")
        return torch.stack([v.float() for v in losses.values()]).sum()

    def predict(self, model: nn.Module, inputs: Sequence[torch.Tensor],
                autocast: Autocast = no_autocast) -> list[dict[str, torch.Tensor]]:
        with autocast():
            out = model(list(inputs))
        return [{k: o[k].float() if k != "labels" else o[k] for k in PREDICTION_KEYS}
                for o in out]

    def new_evaluation(self, dist: DistInfo | None = None) -> DetectionEvaluation:
        return DetectionEvaluation(dist)

    def score(self, predictions: Any, targets: Any) -> dict[str, float]:
        return score_detections(predictions, targets)

