"""Trained models for the exporter tests: real Trainer runs on the digits data, once a run
(:func:`tests.support.built_once.built_once`: however many test processes ask).

small_cnn (width 32) on digits upsampled to 16 px, and resnet (width 32) on the native 8 px
images; each trains in a few seconds on one thread and reaches ~98-99% validation accuracy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch import nn
from torch.utils.data import Dataset

from exporters.onnx_export import OnnxExport, export_onnx
from hpc_core.checkpoint import load_model
from hpc_core.config import DataConfig, TrainConfig, config_from_dict
from hpc_core.data import build_datasets, held_out
from hpc_core.trainer import Trainer
from tests.support.built_once import built_once


@dataclass
class Trained:
    checkpoint: Path
    data: DataConfig
    input_shape: tuple[int, int, int]
    val_acc: float

    def model(self) -> nn.Module:
        """A fresh copy of the trained model (tests may prune it in place)."""
        return load_model(self.checkpoint)[0].eval()

    def splits(self) -> tuple[Dataset, Dataset]:
        train, val, _ = build_datasets(self.data)
        return train, val

    def held_out(self) -> tuple[np.ndarray, np.ndarray]:
        return held_out(self.splits()[1], None)


def _config(out: Path, model: dict[str, Any], image_size: int | None, epochs: int,
            lr: float = 0.003, batch: int = 64, channels_last: bool = False) -> TrainConfig:
    return config_from_dict({
        "run": {"name": "exporters-fixture", "output_dir": str(out), "seed": 0},
        "data": {"source": "digits", "image_size": image_size},
        "model": model,
        "optimizer": {"name": "adamw", "lr": lr, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 20, "decay": "cosine"},
        "training": {"global_batch_size": batch, "epochs": epochs, "device": "cpu",
                     "channels_last": channels_last},
        "checkpoint": {"best_metric": None},
        "logging": {"progress": "off", "log_every_steps": 50},
        "faults": {"handle_signals": False},
    })


def _train(
    out: Path, model: dict[str, Any], image_size: int | None, epochs: int, lr: float = 0.003,
    batch: int = 64, channels_last: bool = False,
) -> Trained:
    cfg = _config(out, model, image_size, epochs, lr, batch, channels_last)
    result = Trainer(cfg).train()
    assert result.checkpoint_dir is not None
    return _trained(cfg, result.checkpoint_dir, result.metrics["eval/acc"])


def _trained(cfg: TrainConfig, checkpoint: Path, val_acc: float) -> Trained:
    size = cfg.data.image_size or 8  # digits' own 8 px where no size is asked
    return Trained(checkpoint, cfg.data, (1, size, size), val_acc)


TRAINED = "trained.json"
"""What a model built once records beside its run: its checkpoint and validation accuracy."""


def _trained_once(tmp_path_factory: pytest.TempPathFactory, name: str, model: dict[str, Any],
                  image_size: int | None, epochs: int) -> Trained:
    """:func:`_train` once per run, whichever test process asks first (the others read it)."""

    def build(out: Path) -> None:
        t = _train(out, model, image_size, epochs)
        (out / TRAINED).write_text(json.dumps({
            "checkpoint": t.checkpoint.relative_to(out).as_posix(), "val_acc": t.val_acc}))

    out = built_once(tmp_path_factory, name, build)
    meta = json.loads((out / TRAINED).read_text())
    return _trained(_config(out, model, image_size, epochs), out / meta["checkpoint"],
                    meta["val_acc"])


@pytest.fixture(scope="session")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    trained = _trained_once(tmp_path_factory, "exporters-cnn",
                            {"name": "small_cnn", "kwargs": {"width": 32}}, 16, 6)
    assert trained.val_acc > 0.95, "the fixture model did not train"
    return trained


@pytest.fixture(scope="session")
def resnet(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    trained = _trained_once(tmp_path_factory, "exporters-resnet",
                            {"name": "resnet", "kwargs": {"width": 32}}, None, 5)
    assert trained.val_acc > 0.95, "the fixture model did not train"
    return trained


@pytest.fixture(scope="session")
def cnn_fp32(cnn: Trained, tmp_path_factory: pytest.TempPathFactory) -> OnnxExport:
    """``cnn`` exported to ONNX once a run (read only: a test writes its own files)."""

    def build(out: Path) -> None:
        # In a folder of its own: what the export writes and nothing else (a test checks).
        (out / "onnx").mkdir()
        done = export_onnx(cnn.model(), out / "onnx" / "fp32.onnx", cnn.input_shape)
        (out / "export.json").write_text(json.dumps({
            **asdict(done), "path": done.path.relative_to(out).as_posix()}))

    out = built_once(tmp_path_factory, "exporters-cnn-onnx", build)
    meta = json.loads((out / "export.json").read_text())
    return OnnxExport(**{**meta, "path": out / meta["path"]})


DETECTOR_SIZE = 64


@dataclass
class TrainedDetector:
    """configs/detection_cpu.yaml's half-width SSDlite, trained at 64 px on 32 synthetic
    images of two shapes."""

    checkpoint: Path
    config: Any
    """Its TrainConfig."""

    def model(self) -> nn.Module:
        return load_model(self.checkpoint)[0].eval()

    def data(self, val_fraction: float = 0.75) -> dict[str, Any]:
        """A job's data section scoring on most of the images the model trained on: a tiny
        detector finds little on images it never saw, and the gates need a figure that
        moves when INT8 breaks it."""
        return {**self.config.data.model_dump(mode="json", exclude_none=True),
                "val_fraction": val_fraction}


@pytest.fixture(scope="session")
def detector(tmp_path_factory: pytest.TempPathFactory) -> TrainedDetector:
    """Trained once per run, shared by the test processes (read only)."""
    from hpc_core.config import load_config

    repo = Path(__file__).resolve().parents[2]

    def config(out: Path) -> Any:
        return load_config(repo / "configs/detection_cpu.yaml", [
            f"run.output_dir={out}", "data.synthetic={images: 32, size: 64, classes: [square, "
            "circle], objects: [1, 1], object_size: [0.4, 0.6]}",
            f"data.image_size={DETECTOR_SIZE}", "data.val_fraction=0.25",
            "training.max_steps=100", "training.eval_every_steps=null",
            "checkpoint.every_steps=null", "schedule.warmup_steps=3", "optimizer.lr=0.003",
            "logging.progress=off", "training.device=cpu", "training.channels_last=false"])

    def train(out: Path) -> None:
        result = Trainer(config(out)).train()
        assert result.checkpoint_dir == out / "checkpoints" / "final", result.checkpoint_dir

    out = built_once(tmp_path_factory, "exporters-detector", train)
    return TrainedDetector(out / "checkpoints" / "final", config(out))
