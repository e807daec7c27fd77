"""The task seam: what the training loop, the evaluations and the gates ask of a task.

One instance per task (:func:`hpc_core.tasks.get_task`), holding no per-run state: what a run
needs is passed in (the data config, the model, the process group). The trainer's step is

    n = task.batch_len(inputs)
    for start in range(0, n, micro):
        x, y = task.to_device(*task.split(inputs, targets, start, start + micro), device)
        task.loss(model, x, y, autocast=...).backward()

and its evaluation

    ev = task.new_evaluation(dist)
    for inputs, targets in val_loader:
        ev.add(task.predict(model, inputs), targets)
    metrics = ev.result()          # every rank calls it: it holds the collective

``score`` is the same metric for outputs made outside torch (numpy logits, numpy
detections from an exported engine).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset

from hpc_core.config import DataConfig
from hpc_core.data import DataInfo
from hpc_core.distributed import DistInfo
from hpc_core.tasks import TaskSpec, passes

Autocast = Callable[[], contextlib.AbstractContextManager[Any]]
"""A factory of the mixed-precision context the forward pass runs in (the trainer's)."""


def no_autocast() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


class Evaluation(ABC):
    """Accumulates one evaluation pass on this rank; :meth:`result` combines the ranks."""

    @abstractmethod
    def add(self, outputs: Any, targets: Any) -> None:
        """One batch: ``outputs`` as :meth:`Task.predict` returns them, ``targets`` as the
        task's ``collate`` batches them."""

    @abstractmethod
    def result(self) -> dict[str, float]:
        """The metrics over every rank's batches (keys: the task's ``spec.metrics``; ``nan``
        where undefined). A collective under DDP: every rank calls it, once."""


class Task(ABC):
    """One task's data, loss, prediction and metrics (see the module docstring)."""

    spec: ClassVar[TaskSpec]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def gate_metric(self) -> str:
        """The key of :meth:`Evaluation.result` the gates compare (higher is better)."""
        return self.spec.gate_metric

    def passes(self, value: float, at_least: float = -math.inf) -> bool:
        """:func:`hpc_core.tasks.passes`: ``nan`` never passes."""
        return passes(value, at_least)

    # -- data ---------------------------------------------------------------------------------

    @abstractmethod
    def build_datasets(self, cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
        """The train and validation splits of ``cfg``, and what a model needs to know."""

    @abstractmethod
    def infer_info(self, train: Dataset, val: Dataset, num_classes: int | None) -> DataInfo:
        """:class:`DataInfo` of data sets handed in directly (not built from a config)."""

    @abstractmethod
    def collate(self, batch: list[Any]) -> tuple[Any, Any]:
        """A ``DataLoader``'s ``collate_fn``: samples to ``(inputs, targets)``."""

    def batch_len(self, inputs: Any) -> int:
        """Samples in a batch's ``inputs``."""
        return len(inputs)

    def split(self, inputs: Any, targets: Any, start: int, stop: int) -> tuple[Any, Any]:
        """Samples ``start:stop`` of a batch (a micro-batch); tensors and lists both slice."""
        return inputs[start:stop], targets[start:stop]

    @abstractmethod
    def to_device(self, inputs: Any, targets: Any, device: torch.device) -> tuple[Any, Any]:
        """The batch on ``device``."""

    # -- model --------------------------------------------------------------------------------

    @abstractmethod
    def loss(self, model: nn.Module, inputs: Any, targets: Any,
             autocast: Autocast = no_autocast) -> torch.Tensor:
        """The mean loss over the batch, a float32 scalar with its graph; ``model`` is in
        train mode (the forward runs under ``autocast()``)."""

    @abstractmethod
    def predict(self, model: nn.Module, inputs: Any, autocast: Autocast = no_autocast) -> Any:
        """The model's outputs for a batch; ``model`` must be in eval mode (the caller's
        job: a trainer restores train mode after evaluating)."""

    # -- metrics ------------------------------------------------------------------------------

    @abstractmethod
    def new_evaluation(self, dist: DistInfo | None = None) -> Evaluation:
        """An empty accumulator; ``dist`` (None: one process) says which ranks combine."""

    @abstractmethod
    def score(self, predictions: Any, targets: Any) -> dict[str, float]:
        """The evaluation's metrics for outputs made outside torch, all in one process:
        classification takes logits (N, C) and labels (N,), detection per-image dicts of
        numpy arrays (``boxes`` xyxy, ``scores``, ``labels``; targets ``boxes``,
        ``labels``, optional ``iscrowd``), labels as the task's data sets give them."""

    def evaluate(self, model: nn.Module, batches: Iterable[tuple[Any, Any]],
                 device: torch.device | str = "cpu", dist: DistInfo | None = None,
                 autocast: Autocast = no_autocast) -> dict[str, float]:
        """``model``'s metrics over ``batches`` (a loader of ``(inputs, targets)``), in eval
        mode with gradients off; the caller restores train mode if it needs it."""
        model.eval()
        ev = self.new_evaluation(dist)
        with torch.no_grad():
            for inputs, targets in batches:
                inputs, targets = self.to_device(inputs, targets, torch.device(device))
                ev.add(self.predict(model, inputs, autocast), targets)
        return ev.result()
