"""Detectors through the one training loop, on the synthetic set at 64 px: the loss falls,
micro-batches (lists split) and the OOM halving give the full batch's update, a stopped run
resumes to the uninterrupted one bit for bit, the best checkpoint and early stopping follow
eval/map, and hpc-train trains, evaluates and publishes a version whose manifest says
``task: detection``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hpc_core import checkpoint as ckpt
from hpc_core.cli import main
from hpc_core.config import TrainConfig, apply_overrides, config_from_dict, load_config
from hpc_core.faults import FaultInjector
from hpc_core.metrics import read_metrics
from hpc_core.model_spec import read_checkpoint
from hpc_core.tasks.detection.sources import build_detection_datasets
from hpc_core.tasks.detection.synthetic import write_synthetic
from hpc_core.trainer import Trainer
from hpc_core.vision.builders import resolve
from registry.manifest import Manifest
from registry.publish import sign_version
from registry.signing import SigningKey

REPO = Path(__file__).resolve().parents[4]


def det_config(out: Path, overrides: list[str] | None = None) -> TrainConfig:
    """6 synthetic images of 64 px (4 train, 2 val), batch 4: one step per epoch."""
    tree: dict[str, Any] = {
        "task": "detection",
        "run": {"name": "det", "output_dir": str(out), "seed": 0},
        "data": {"source": "synthetic_detection", "synthetic": {"images": 6, "size": 64},
                 "val_fraction": 0.34},
        # few candidates per level: an untrained head scores thousands of boxes above the
        # threshold, and NMS over them would dominate an evaluation
        "model": {"name": "torchvision/retinanet_resnet18_fpn", "kwargs": {"topk_candidates": 20}},
        "optimizer": {"name": "adamw", "lr": 0.0003},
        "training": {"global_batch_size": 4, "max_steps": 2, "device": "cpu"},
        "checkpoint": {"best_metric": None, "save_final": False},
        "logging": {"progress": "off", "log_every_steps": 1},
    }
    return config_from_dict(apply_overrides(tree, overrides or []))


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.raw_model.state_dict().items()}


def frozen_bn_retinanet() -> nn.Module:
    """RetinaNet normalises its losses per image, and with BatchNorm frozen (eval mode, the
    trainer's rule for BN without trainable parameters) no statistic depends on which images
    share a micro-batch: k micro-batches must give the full batch's gradient."""
    torch.manual_seed(0)
    model = resolve("torchvision/retinanet_resnet18_fpn")(num_classes=14, in_channels=3,
                                                          image_size=64, topk_candidates=20)
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            for p in m.parameters():
                p.requires_grad_(False)
    return model


def test_micro_batches_and_oom_halving_give_the_full_batch_update(tmp_path: Path) -> None:
    full = Trainer(det_config(tmp_path / "full"), model=frozen_bn_retinanet())
    full.train()
    micro = Trainer(det_config(tmp_path / "micro", ["training.micro_batch_size=1"]),
                    model=frozen_bn_retinanet())
    micro.train()
    # From step 2 on a micro-batch above one image "runs out of memory": 4 -> 2 -> 1.
    oom = Trainer(det_config(tmp_path / "oom"), model=frozen_bn_retinanet(),
                  faults=FaultInjector(oom_step=2, oom_above=1))
    assert oom.train().final_step == 2 and oom.state.micro_batch_size == 1
    ref = params(full)
    init = frozen_bn_retinanet().state_dict()
    assert [k for k in ref if not torch.equal(ref[k], init[k])], "the weights did not move"
    for other in (micro, oom):
        got = params(other)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, k=k: f"{k}: {m}")
    events = [e for e in read_metrics(tmp_path / "oom" / "metrics.jsonl") if e.get("event")]
    assert [(e["step"], e["micro_batch_from"], e["micro_batch_to"]) for e in events] == [
        (2, 4, 2), (2, 2, 1)]


def test_a_detector_trains_its_loss_falls_and_map_is_finite(tmp_path: Path) -> None:
    cfg = det_config(tmp_path, ["model.name=torchvision/ssdlite320_mobilenet_v3_large",
                                "model.kwargs={}", "optimizer.lr=0.001",
                                "training.max_steps=6"])
    result = Trainer(cfg).train()
    losses = [m["train/loss"] for m in read_metrics(tmp_path / "metrics.jsonl")
              if "train/loss" in m]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    assert set(result.metrics) == {"eval/map", "eval/map50", "eval/map75", "eval/ar100"}
    assert all(math.isfinite(v) and 0 <= v <= 1 for v in result.metrics.values())


class StopAt:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if step == self.step:
            trainer.request_stop("test")


def test_stopped_and_resumed_equals_uninterrupted_bitwise(tmp_path: Path) -> None:
    # BatchNorm in train mode, AdamW moments, the loader's order: all must be restored.
    sets = ["training.max_steps=4", "checkpoint.save_final=true"]
    whole = Trainer(det_config(tmp_path / "whole", sets))
    whole.train()
    cut = Trainer(det_config(tmp_path / "cut", sets), hooks=[StopAt(2)])
    stopped = cut.train()
    assert (stopped.stopped_reason, stopped.final_step) == ("requested: test", 2)
    resumed = Trainer(det_config(tmp_path / "cut", sets))
    result = resumed.train(resume="auto")
    assert result.final_step == 4
    a, b = params(whole), params(resumed)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert result.metrics == {k: v for k, v in whole.last_eval.items() if k != "step"}


def test_best_checkpoint_and_early_stopping_follow_eval_map(tmp_path: Path) -> None:
    cfg = det_config(tmp_path, [
        "training.max_steps=6", "training.eval_every_steps=1",
        "checkpoint.best_metric=eval/map",
        # an improvement of 1.0 in mAP is impossible: stop after the second evaluation
        "training.early_stopping.patience=1", "training.early_stopping.min_delta=1.0"])
    assert cfg.training.early_stopping.metric == "eval/map"  # the task's default
    result = Trainer(cfg).train()
    assert (result.stopped_reason, result.final_step) == ("early_stopping", 2)
    maps = [m["eval/map"] for m in read_metrics(tmp_path / "metrics.jsonl") if "eval/map" in m]
    best = ckpt.best_target(tmp_path / "checkpoints")
    assert best is not None
    assert ckpt.read_trainer_state(best)["metrics"]["eval/map"] == max(maps)


def test_the_cpu_recipe_detects_in_eval_mode_after_a_short_run(tmp_path: Path) -> None:
    # configs/detection_cpu.yaml's model and optimizer, 80 steps from scratch on 16 images of
    # two shapes (64 px), scored on those images in eval mode: BatchNorm's running statistics
    # must have followed the weights (0.94 here; torchvision's momentum of 0.03 gives 0.21)
    cfg = load_config(REPO / "configs/detection_cpu.yaml", [
        f"run.output_dir={tmp_path}", "data.synthetic={images: 16, size: 64, classes: [square, "
        "circle], objects: [1, 1], object_size: [0.4, 0.6]}", "data.image_size=64",
        "data.val_fraction=0.1", "training.max_steps=80", "training.eval_every_steps=null",
        "checkpoint.every_steps=null", "schedule.warmup_steps=3", "optimizer.lr=0.003",
        "logging.progress=off", "training.device=cpu"])
    assert cfg.model.kwargs["bn_momentum"] == 0.1
    train, _, _ = build_detection_datasets(cfg.data)
    result = Trainer(cfg, datasets=(train, train)).train()
    assert result.metrics["eval/map50"] >= 0.6


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/detection.yaml through hpc-train train, made tiny."""
    out = tmp_path_factory.mktemp("cli") / "run"
    argv = ["train", "--config", str(REPO / "configs/detection.yaml")]
    for s in [f"run.output_dir={out}", "data.synthetic={images: 6, size: 64}",
              "data.image_size=64", "data.val_fraction=0.34", "training.global_batch_size=2",
              "training.epochs=null", "training.max_steps=2", "training.eval_every_steps=2",
              "checkpoint.every_steps=null", "schedule.warmup_steps=1", "logging.progress=off",
              "training.device=cpu"]:
        argv += ["--set", s]
    assert main(argv) == 0
    return out


def test_hpc_train_trains_and_evaluates_a_detector(cli_run: Path, capsys) -> None:
    capsys.readouterr()
    assert main(["evaluate", str(cli_run)]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["task"] == "detection" and own["samples"] == 2
    assert own["gate_metric"] == "eval/map" and 0 <= own["eval/map"] <= 1
    final = ckpt.read_trainer_state(cli_run / "checkpoints" / "final")["metrics"]
    assert own["eval/map"] == pytest.approx(final["eval/map"], abs=1e-9)
    # another set: 8 images of seed 1, 3 held out
    assert main(["evaluate", str(cli_run), "--set", "data.synthetic={images: 8, size: 64, "
                 "seed: 1}"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 3
    assert main(["evaluate", str(cli_run), "--config", str(REPO / "configs/digits.yaml")]) == 2
    assert "holds a detection model" in capsys.readouterr().err


def test_published_manifest_carries_the_task(cli_run: Path) -> None:
    content = read_checkpoint(cli_run)
    assert content.model.task == "detection" and content.model.num_classes == 14
    key = SigningKey(name="upstream", key_id="0" * 16, private=Ed25519PrivateKey.generate())
    signed = sign_version(name="det", version="1", sequence=1, model=content.model,
                          tensors=content.tensors, key=key, on_chunk=lambda ref, data: None,
                          training=content.training, spec_layout=content.layout)
    doc = json.loads(signed.manifest_bytes)
    assert doc["model"]["task"] == "detection"
    assert doc["layout"]["built_from"]["task"] == "detection"
    manifest = Manifest.from_bytes(signed.manifest_bytes)
    assert manifest.model.task == "detection"
    # a classifier's manifest leaves the field out: the bytes it had before the field existed
    as_classifier = manifest.model_copy(update={
        "model": manifest.model.model_copy(update={"task": "classification"}),
        "layout": manifest.layout.model_copy(update={"built_from": manifest.layout.built_from
                                                     .model_copy(update={"task":
                                                                         "classification"})})})
    assert b'"task"' not in as_classifier.to_bytes()
    assert Manifest.from_bytes(as_classifier.to_bytes()).model.task == "classification"


@pytest.mark.parametrize("name", ["retinanet_resnet18_fpn", "ssdlite320_mobilenet_v3_large"])
def test_coco_weights_load_with_the_class_head_left_fresh(name: str) -> None:
    """A torchvision COCO checkpoint (91 classes) starts a 14-class detector: every tensor
    but the per-class convolutions loads; those stay fresh and are reported."""
    from hpc_core.vision.weights import fit_state_dict

    build = resolve(f"torchvision/{name}")
    coco = build(num_classes=91, in_channels=3, image_size=64).state_dict()
    torch.manual_seed(0)
    model = build(num_classes=14, in_channels=3, image_size=64)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = fit_state_dict(model, coco, "coco.pth")
    assert report.head_reset and all(k.startswith("head.classification_head.")
                                     for k in report.head_reset)
    own = model.state_dict()
    for k in own:
        expected = fresh[k] if k in report.head_reset else coco[k]
        assert torch.equal(own[k], expected), k


@pytest.mark.parametrize("source", ["coco", "yolo"])
def test_a_detector_trains_on_a_folder(tmp_path: Path, source: str) -> None:
    folder = write_synthetic(tmp_path / "set", 6, size=64, seed=2, formats=(source,))
    cfg = det_config(tmp_path / "run", [f"data.source={source}", f"data.path={folder}",
                                        "data.synthetic=null", "training.max_steps=1"])
    trainer = Trainer(cfg)
    assert (len(trainer.train_ds), len(trainer.val_ds)) == (4, 2)
    assert cfg.model.num_classes is None and trainer.cfg.model.num_classes == 14
    result = trainer.train()
    assert result.final_step == 1 and math.isfinite(result.metrics["eval/map"])
