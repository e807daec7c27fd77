"""Image classification: one class per image, cross-entropy, top-1 accuracy.

The data sets are ``hpc_core.data``'s (digits, image folders, .npz arrays): each sample is
``(x float32 CHW, y int64)`` and a batch is two tensors. The model maps ``(N, C, H, W)`` to
logits ``(N, num_classes)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, default_collate

from hpc_core.config import DataConfig
from hpc_core.data import DataInfo, TensorImageDataset, build_datasets
from hpc_core.distributed import DistInfo, all_reduce_sum
from hpc_core.tasks import TASKS
from hpc_core.tasks.base import Autocast, Evaluation, Task, no_autocast
from hpc_core.tasks.classification_score import score_logits


class ClassificationEvaluation(Evaluation):
    """Sums of the loss, the correct top-1 predictions and the samples; DDP all-reduces the
    sums, so every rank gets the metrics of the whole validation set."""

    def __init__(self, dist: DistInfo | None) -> None:
        self.dist = dist
        self.loss_sum, self.correct, self.count = 0.0, 0.0, 0.0

    def add(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.loss_sum += float(F.cross_entropy(outputs.float(), targets, reduction="sum"))
        self.correct += float((outputs.argmax(1) == targets).sum())
        self.count += len(targets)

    def result(self) -> dict[str, float]:
        sums = [self.loss_sum, self.correct, self.count]
        loss_sum, correct, count = sums if self.dist is None else all_reduce_sum(sums, self.dist)
        return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1)}


class ClassificationTask(Task):
    spec = TASKS["classification"]

    def build_datasets(self, cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
        return build_datasets(cfg)

    def infer_info(self, train: Dataset, val: Dataset, num_classes: int | None) -> DataInfo:
        x0, _ = train[0]
        if num_classes is None:
            labels: Iterator[int]
            if isinstance(train, TensorImageDataset):
                labels = iter(train.y.tolist())
            else:
                labels = (int(train[i][1]) for i in range(len(train)))  # type: ignore[arg-type]
            num_classes = max(labels) + 1
        return DataInfo(num_classes, int(x0.shape[0]), int(x0.shape[-1]), len(train),  # type: ignore[arg-type]
                        len(val))  # type: ignore[arg-type]

    def collate(self, batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return default_collate(batch)  # type: ignore[no-any-return]

    def to_device(self, inputs: torch.Tensor, targets: torch.Tensor,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             autocast: Autocast = no_autocast) -> torch.Tensor:
        with autocast():
            logits = model(inputs)
        return F.cross_entropy(logits.float(), targets)

    def predict(self, model: nn.Module, inputs: torch.Tensor,
                autocast: Autocast = no_autocast) -> torch.Tensor:
        with autocast():
            return model(inputs)  # type: ignore[no-any-return]

    def new_evaluation(self, dist: DistInfo | None = None) -> ClassificationEvaluation:
        return ClassificationEvaluation(dist)

    def score(self, predictions: Any, targets: Any) -> dict[str, float]:
        """Cross-entropy and top-1 of logits ``(N, C)`` against labels ``(N,)`` (numpy or
        anything ``np.asarray`` takes), in float64 (:func:`.classification_score.score_logits`,
        torch-free)."""
        return score_logits(predictions, targets)
