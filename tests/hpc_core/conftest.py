from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpc_core.config import TrainConfig, apply_overrides, config_from_dict


def small_config(
    output_dir: Path, overrides: list[str] | None = None, **sections: Any
) -> TrainConfig:
    """A fast digits config; ``sections`` replace whole sections, overrides are KEY=VALUE."""
    tree: dict[str, Any] = {
        "run": {"name": "test", "output_dir": str(output_dir), "seed": 0},
        "data": {"source": "digits"},
        "model": {"name": "mlp", "kwargs": {"hidden": [64]}},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "training": {"global_batch_size": 64, "max_steps": 5, "grad_clip_norm": None},
        "checkpoint": {"best_metric": None},
        "logging": {"progress": "off", "log_every_steps": 1},
    }
    tree.update(sections)
    return config_from_dict(apply_overrides(tree, overrides or []))


@pytest.fixture
def make_config(tmp_path: Path):
    def make(name: str = "run", overrides: list[str] | None = None, **sections: Any) -> TrainConfig:
        return small_config(tmp_path / name, overrides, **sections)

    return make
