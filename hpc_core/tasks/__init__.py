"""What the model is trained to do: one implementation per task, behind one seam.

A task owns everything that differs between classifying an image and finding objects in it,
so that the one training loop (``hpc_core.trainer``), the gates and the evaluations stay one
code path each and never branch on a task's name (:class:`hpc_core.tasks.base.Task`):

- its data: the sources it reads, a ``Dataset`` and the ``collate`` that batches it
  (detection batches are lists: images differ in size and box counts), and how a batch is
  cut into micro-batches and moved to the device;
- its loss, and how a batch of targets reaches the model;
- its metrics and their evaluation over a validation set, DDP-safe;
- the one scalar the gates compare (top-1 accuracy for classification, mAP@0.5:0.95 for
  detection), and :func:`passes`: ``nan`` never passes;
- what a served response carries (a class and its score; boxes, labels and scores).

This module is torch-free (the config validates against :data:`TASKS`, the torch-free
aggregation gates use :func:`passes`); :func:`get_task` imports an implementation only when
it is asked for. Implementations: ``hpc_core.tasks.classification`` and
``hpc_core.tasks.detection.task``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from functools import cache
from typing import Any, get_args

from registry.model_config import TaskName

__all__ = ["TASKS", "TaskName", "TaskSpec", "get_task", "passes", "score", "task_spec"]


@dataclass(frozen=True)
class TaskSpec:
    """What the config and the gates know of a task without importing torch."""

    name: str
    gate_metric: str
    """The evaluation key the gates compare (higher is better), e.g. ``acc``; the trainer
    logs it as ``eval/<key>``."""
    gate_label: str
    """The gate metric as people read it in a verdict (``accuracy``, ``mAP@0.5:0.95``)."""
    metrics: tuple[str, ...]
    """Every key its evaluation reports (the trainer logs each as ``eval/<key>``)."""
    sources: tuple[str, ...]
    """The ``data.source`` values it trains on."""
    implementation: str
    """``module:Class`` of its :class:`~hpc_core.tasks.base.Task`."""
    scorer: str
    """``module:function`` behind ``Task.score`` (:func:`score`): its module imports torch
    only where the task's outputs need it, so a torch-free process (an export's quantizing
    half, which gates ONNX Runtime's logits) scores a classifier without loading torch."""

    @property
    def eval_metrics(self) -> tuple[str, ...]:
        """The metric names as the trainer logs them (``eval/acc``, ...)."""
        return tuple(f"eval/{k}" for k in self.metrics)


TASKS: dict[str, TaskSpec] = {
    "classification": TaskSpec(
        "classification", "acc", "accuracy", ("loss", "acc"), ("digits", "image_folder", "npz"),
        "hpc_core.tasks.classification:ClassificationTask",
        "hpc_core.tasks.classification_score:score_logits"),
    "detection": TaskSpec(
        "detection", "map", "mAP@0.5:0.95", ("map", "map50", "map75", "ar100"),
        ("coco", "yolo", "synthetic_detection"),
        "hpc_core.tasks.detection.task:DetectionTask",
        "hpc_core.tasks.detection.task:score_detections"),
    # segmentation would go here: masks from COCO polygons / RLE, its metric mean IoU, the
    # implementation hpc_core.tasks.segmentation.task:SegmentationTask (and its name in
    # registry.model_config.TaskName).
}
assert set(TASKS) == set(get_args(TaskName)), "TASKS and registry.model_config.TaskName differ"


def task_spec(name: str) -> TaskSpec:
    """The spec of task ``name``; ValueError naming the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"task {name!r} is not known: use one of {', '.join(TASKS)}") from None


@cache
def get_task(name: str) -> Any:
    """The one :class:`hpc_core.tasks.base.Task` instance of task ``name`` (imports its
    implementation, and torch). Typed ``Any`` here because this module stays torch-free, even
    for the type checker's import graph: annotate the result as ``Task`` where it is used."""
    module, _, cls = task_spec(name).implementation.partition(":")
    return getattr(importlib.import_module(module), cls)()


def score(name: str, predictions: Any, targets: Any) -> dict[str, float]:
    """Task ``name``'s metrics of outputs made outside torch (``Task.score``: logits and labels
    for classification, per-image numpy dicts for detection), importing only its scorer's
    module: torch-free for a classifier."""
    module, _, fn = task_spec(name).scorer.partition(":")
    return getattr(importlib.import_module(module), fn)(  # type: ignore[no-any-return]
        predictions, targets)


def passes(value: float, at_least: float = -math.inf) -> bool:
    """Whether a gate metric ``value`` passes a threshold: ``nan`` (no ground truth, nothing
    evaluated, a diverged model) always fails, whatever the threshold.

    Compare through this, never with a bare ``>=`` on a negated test (``not value < x`` is
    True for ``nan``)."""
    return not math.isnan(value) and value >= at_least
