"""The held-out device data the health and evaluate steps score models on, and its scoring:
through the model's task (``hpc_core.tasks``), never by hand, so that a classifier is judged
by top-1 accuracy and a detector by COCO's mAP on the same code path.

Child side only (torch): the data sets come from the task, the models run in whatever
``runner_for`` gives (ONNX Runtime, TensorRT, or torch where a version has no exported
artefact, as a detector's has none yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.jobs.protocol import StepContext


@dataclass
class HeldOut:
    """The samples both models see, in one order."""

    task: str
    """The model's task (``hpc_core.tasks``): what scores the outputs."""
    inputs: np.ndarray
    """Images, float32 (N, C, H, W)."""
    targets: Any
    """What the task's ``score`` compares outputs with: labels (N,), or one dict per image
    (boxes, labels); None where the job has no data (load and finite outputs only)."""

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def gate_metric(self) -> str:
        from hpc_core.tasks import task_spec

        return task_spec(self.task).gate_metric

    @property
    def gate_label(self) -> str:
        from hpc_core.tasks import task_spec

        return task_spec(self.task).gate_label

    def score(self, outputs: Any) -> dict[str, float]:
        """The task's metrics of ``outputs`` (as ``exporters.runtime.predict`` returns them)
        against the targets; the gate metric is ``nan`` where it is undefined."""
        from hpc_core.tasks import get_task

        return dict(get_task(self.task).score(outputs, self.targets))

    def figures(self, outputs: Any) -> dict[str, Any]:
        """One model's figures: ``metric`` (the gate metric, ``nan`` when undefined: it never
        passes), every metric of the task, and ``accuracy`` (top-1, for the readers that
        predate the task seam; None for a task without it)."""
        scores = self.score(outputs)
        metric = scores[self.gate_metric]
        return {"accuracy": scores.get("acc"), "metric": metric,
                "metrics": {k: _json_number(v) for k, v in scores.items()}}

    def worst(self) -> dict[str, Any]:
        """The figures of a model that scores nothing (non-finite outputs): 0 for each."""
        from hpc_core.tasks import task_spec

        zero = dict.fromkeys(task_spec(self.task).metrics, 0.0)
        return {"accuracy": zero.get("acc"), "metric": 0.0, "metrics": zero}


def _json_number(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


def metric_of(figures: dict[str, Any]) -> float:
    """A model's gate metric from its recorded figures (``accuracy`` in a job recorded before
    the task seam; ``nan`` for None: an undefined metric never passes)."""
    v = figures.get("metric", figures.get("accuracy"))
    return float("nan") if v is None else float(v)


def finite(outputs: Any) -> bool:
    """Whether every float in ``outputs`` (an array, or per-sample dicts of arrays) is finite."""
    if isinstance(outputs, np.ndarray):
        return bool(np.isfinite(outputs).all()) if outputs.dtype.kind == "f" else True
    if isinstance(outputs, dict):
        return all(finite(v) for v in outputs.values())
    if isinstance(outputs, (list, tuple)):
        return all(finite(o) for o in outputs)
    return True


def _train_config(c: StepContext) -> tuple[str, dict[str, Any]] | None:
    """The task and the held-out split's data config: the fine-tune's own, or (a deploy or an
    evaluation) one built the fine-tune's way from the job's data; None when there is none."""
    if c.setup is not None:
        cfg = c.setup["config"]
        return cfg.get("task", "classification"), dict(cfg["data"])
    if not c.spec.get("data"):
        return None
    from agent.finetune.job import FinetuneJob, build_config
    from agent.finetune.model import load_upstream

    assert c.staged_path is not None
    _, upstream = load_upstream(c.staged_path)
    job = FinetuneJob(checkpoint=c.staged_path, data=c.spec["data"], out=c.job_dir / "health")
    cfg = build_config(job, upstream, "fp32", None)
    return cfg.task, cfg.data.model_dump(mode="json")


def held_out_data(c: StepContext, samples: int | None) -> HeldOut:
    """The first ``samples`` (all: None) of the job's held-out split, as the task builds it;
    with no data, a fixed random batch that checks the model loads and stays finite."""
    import torch

    from hpc_core.config import DataConfig
    from hpc_core.tasks import get_task

    found = _train_config(c)
    if found is None:
        from agent.finetune.model import load_upstream

        assert c.staged_path is not None
        _, m = load_upstream(c.staged_path)
        rng = np.random.default_rng(0)
        shape = (32, m.in_channels, m.image_size, m.image_size)
        return HeldOut(m.task, rng.random(shape, dtype=np.float32), None)
    name, data = found
    task = get_task(name)
    _, val, _ = task.build_datasets(DataConfig.model_validate(data))
    n = len(val) if samples is None else min(samples, len(val))
    inputs, targets = task.collate([val[i] for i in range(n)])
    if not isinstance(inputs, torch.Tensor):
        sizes = {tuple(im.shape) for im in inputs}
        if len(sizes) > 1:
            raise ValueError(f"the held-out images differ in size ({sorted(sizes)[:3]}): "
                             "the data config must letterbox them (data.image_size)")
        inputs = torch.stack(list(inputs))
    x = np.ascontiguousarray(inputs.numpy(), dtype=np.float32)
    y = targets.numpy() if isinstance(targets, torch.Tensor) else targets
    return HeldOut(name, x, y)
