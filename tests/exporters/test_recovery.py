from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from exporters.job import PruneSpec, RecoveryConfig
from exporters.prune import prune_model
from exporters.recovery import MaskKeeper, recover, recovery_train_config
from hpc_core.checkpoint import load_model
from hpc_core.trainer import Trainer


def _zeros_kept(model: torch.nn.Module, masks: dict[str, torch.Tensor]) -> bool:
    params = dict(model.named_parameters())
    return all(bool((params[n][~m] == 0).all()) for n, m in masks.items())


def test_fine_tune_through_the_trainer_keeps_the_2_4_masks(cnn: Any, tmp_path: Path) -> None:
    model = cnn.model()
    _, cfg = load_model(cnn.checkpoint)
    result = prune_model(model, PruneSpec.model_validate("2:4"), torch.zeros(1, *cnn.input_shape))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rec = recover(model, result.masks, cnn.splits(), cfg, RecoveryConfig(steps=15),
                  tmp_path / "recovery")
    assert rec.steps == 15
    assert _zeros_kept(model, result.masks)
    # It did train: the surviving weights moved.
    params = dict(model.named_parameters())
    moved = [n for n in result.masks if not torch.equal(params[n], before[n])]
    assert moved == list(result.masks)
    assert rec.metrics["eval/acc"] > 0.9


def test_without_the_hook_the_optimizer_revives_pruned_weights(cnn: Any, tmp_path: Path) -> None:
    """The control for the test above: the mask keeping is the hook's doing."""
    model = cnn.model()
    _, cfg = load_model(cnn.checkpoint)
    result = prune_model(model, PruneSpec.model_validate("2:4"), torch.zeros(1, *cnn.input_shape))
    train_cfg = recovery_train_config(cfg, RecoveryConfig(steps=3), tmp_path, 1000)
    Trainer(train_cfg, model=model, datasets=cnn.splits()).train()
    assert not _zeros_kept(model, result.masks)


def test_mask_keeper_reapplies_after_every_step(cnn: Any, tmp_path: Path) -> None:
    model = cnn.model()
    _, cfg = load_model(cnn.checkpoint)
    result = prune_model(model, PruneSpec.model_validate("unstructured:0.8:global"),
                         torch.zeros(1, *cnn.input_shape))
    keeper = MaskKeeper(model, result.masks)
    train_cfg = recovery_train_config(cfg, RecoveryConfig(steps=4), tmp_path, 1000)
    Trainer(train_cfg, model=model, datasets=cnn.splits(), hooks=[keeper]).train()
    assert keeper.applied == 4
    assert _zeros_kept(model, result.masks)


def test_recovery_config_is_a_short_quiet_fine_tune(cnn: Any, tmp_path: Path) -> None:
    _, cfg = load_model(cnn.checkpoint)
    tc = recovery_train_config(cfg, RecoveryConfig(steps=50, batch_size=512), tmp_path, 300)
    assert tc.training.max_steps == 50
    assert tc.training.global_batch_size == 300  # never more than the training split
    assert tc.checkpoint.save_final is False and tc.checkpoint.best_metric is None
    assert tc.faults.handle_signals is False
    assert tc.model == cfg.model and tc.data == cfg.data
    assert tc.optimizer.lr == cfg.optimizer.lr  # by default the checkpoint's own LR
    assert recovery_train_config(cfg, RecoveryConfig(lr=1e-4), tmp_path, 300).optimizer.lr == 1e-4


def test_recovery_trains_in_the_memory_order_the_model_trained_in(cnn: Any,
                                                                   tmp_path: Path) -> None:
    """A model trained in NHWC (training.channels_last) recovers in NHWC, and the masks hold
    there too: they are kept through the weights' logical indices, whatever their strides."""
    _, cfg = load_model(cnn.checkpoint)
    assert recovery_train_config(cfg, RecoveryConfig(), tmp_path, 300).training.channels_last \
        is False
    nhwc = cfg.model_copy(update={"training": cfg.training.model_copy(
        update={"channels_last": True})})
    assert recovery_train_config(nhwc, RecoveryConfig(), tmp_path, 300).training.channels_last
    model = cnn.model()
    result = prune_model(model, PruneSpec.model_validate("2:4"), torch.zeros(1, *cnn.input_shape))
    rec = recover(model, result.masks, cnn.splits(), nhwc, RecoveryConfig(steps=6),
                  tmp_path / "recovery")
    assert rec.steps == 6
    convs = [p for p in model.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert _zeros_kept(model, result.masks)
