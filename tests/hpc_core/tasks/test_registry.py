"""The task registry (hpc_core.tasks) and the config's task field: what is refused, with
which field named; a nan gate metric never passes."""

from __future__ import annotations

import math
import subprocess
from typing import Any, get_args

import pytest

from hpc_core.config import ConfigError, config_from_dict
from hpc_core.tasks import TASKS, get_task, passes, task_spec
from registry.model_config import ModelConfig, TaskName

DET = {"task": "detection", "data": {"source": "synthetic_detection"}}


def refused(tree: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict(tree)
    return str(e.value)


def test_every_task_name_has_a_spec_and_an_implementation() -> None:
    assert set(TASKS) == set(get_args(TaskName))
    for name, spec in TASKS.items():
        task = get_task(name)
        assert task.spec is spec and spec.gate_metric in spec.metrics
    with pytest.raises(ValueError, match="task 'segmentation' is not known: use one of "
                       "classification, detection"):
        task_spec("segmentation")


def test_the_registry_is_torch_free(python: str, subprocess_env: dict[str, str]) -> None:
    code = ("import sys, hpc_core.tasks, hpc_core.config; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([python, "-c", code], check=True, timeout=120, env=subprocess_env)


def test_nan_never_passes() -> None:
    assert passes(0.5, 0.4) and passes(0.0) and not passes(0.3, 0.4)
    assert not passes(math.nan) and not passes(math.nan, -math.inf)
    assert not get_task("detection").passes(math.nan)


def test_default_task_is_classification_everywhere() -> None:
    cfg = config_from_dict({})
    assert cfg.task == cfg.model.task == "classification"
    assert cfg.checkpoint.best_metric == cfg.training.early_stopping.metric == "eval/acc"
    assert ModelConfig().task == "classification"  # a manifest without the field


def test_detection_config_follows_the_task() -> None:
    cfg = config_from_dict(DET)
    assert cfg.model.task == "detection"
    assert cfg.checkpoint.best_metric == cfg.training.early_stopping.metric == "eval/map"
    # the resolved config loads back to itself (a checkpoint's trainer_state.json)
    assert config_from_dict(cfg.to_dict()) == cfg
    assert config_from_dict({**DET, "checkpoint": {"best_metric": None}}).checkpoint.best_metric \
        is None


def test_a_manifests_model_spec_brings_its_task() -> None:
    spec = ModelConfig(task="detection", name="torchvision/fcos_resnet18_fpn").model_dump()
    cfg = config_from_dict({"model": spec, "data": {"source": "synthetic_detection"}})
    assert cfg.task == "detection" and cfg.checkpoint.best_metric == "eval/map"
    assert "task='detection' reads coco" in refused({"model": spec})


@pytest.mark.parametrize(("tree", "message"), [
    ({"task": "detection"}, "data.source='digits' is classification data, but task='detection' "
     "reads coco, yolo, synthetic_detection"),
    ({"task": "segmentation"}, "task: Input should be 'classification' or 'detection'"),
    ({"data": {"source": "coco", "path": "x"}}, "data.source='coco' is detection data, but "
     "task='classification'"),
    ({**DET, "model": {"task": "classification"}}, "model.task='classification' disagrees with "
     "task='detection': set only the top-level task"),
    ({**DET, "checkpoint": {"best_metric": "eval/acc"}}, "checkpoint.best_metric='eval/acc': "
     "task detection reports eval/map, eval/map50, eval/map75, eval/ar100"),
    ({**DET, "training": {"epochs": 1, "early_stopping": {"metric": "eval/loss"}}},
     "training.early_stopping.metric='eval/loss'"),
    ({"data": {"synthetic": {"images": 8}}}, "data.synthetic is set but data.source='digits' "
     "does not read it"),
    ({"data": {"source": "npz", "path": "x.npz", "val_split": "val"}}, "data.val_split: only "
     "coco and yolo folders have these"),
    ({"task": "detection", "data": {"source": "coco"}}, "data.path is required for "
     "source='coco': set it to the folder"),
    ({**DET, "data": {"source": "synthetic_detection", "synthetic": {"cameras": ["fisheye"]}}},
     "data.synthetic.cameras.0: Input should be 'invert', 'noise', 'blur' or 'rotate'"),
])
def test_refusals_name_the_field(tree: dict[str, Any], message: str) -> None:
    assert message in refused(tree)
