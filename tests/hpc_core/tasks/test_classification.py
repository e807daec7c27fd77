"""The classification task against hand computation: cross-entropy and top-1 through the
loss, the accumulator (batch by batch) and the numpy scorer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from hpc_core.config import DataConfig
from hpc_core.data import TensorImageDataset
from hpc_core.tasks import get_task
from hpc_core.tasks.classification import ClassificationTask

TASK = get_task("classification")

# Three samples, three classes; by hand: softmax of [2, 1, 0] gives p(0) = e^2 / (e^2 + e + 1).
LOGITS = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 4.0, 1.0]])
LABELS = torch.tensor([0, 1, 1])


def hand_ce(logits: list[float], label: int) -> float:
    return -math.log(math.exp(logits[label]) / sum(math.exp(v) for v in logits))


HAND_LOSS = sum(hand_ce(row, int(y)) for row, y in zip(LOGITS.tolist(), LABELS, strict=True)) / 3
HAND_ACC = 2 / 3  # rows 0 and 2 are right, row 1 says 2 for a 1


class Fixed(nn.Module):
    """Returns the logits it was given, whatever the input (a model with known outputs)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[x.long().view(-1)]


def test_registry_hands_out_one_instance() -> None:
    assert isinstance(TASK, ClassificationTask)
    assert get_task("classification") is TASK
    assert TASK.gate_metric == "acc" and TASK.name == "classification"


def test_loss_is_mean_cross_entropy_by_hand() -> None:
    model = Fixed(LOGITS)
    loss = TASK.loss(model, torch.arange(3), LABELS)
    assert float(loss.detach()) == pytest.approx(HAND_LOSS, rel=1e-6)
    loss.backward()  # the graph is there
    assert model.logits.grad is not None


def test_accumulator_over_uneven_batches_matches_hand() -> None:
    ev = TASK.new_evaluation()
    ev.add(LOGITS[:2], LABELS[:2])
    ev.add(LOGITS[2:], LABELS[2:])
    out = ev.result()
    assert out["loss"] == pytest.approx(HAND_LOSS, rel=1e-6)
    assert out["acc"] == pytest.approx(HAND_ACC)


def test_numpy_score_matches_hand_and_the_accumulator() -> None:
    out = TASK.score(LOGITS.numpy(), LABELS.numpy())
    assert out == pytest.approx({"loss": HAND_LOSS, "acc": HAND_ACC}, rel=1e-9)
    assert math.isnan(TASK.score(np.zeros((0, 3)), np.zeros(0))["acc"])
    with pytest.raises(ValueError, match=r"logits \(N, C\)"):
        TASK.score(np.zeros(3), np.zeros(3))


def test_evaluate_uses_eval_mode_and_the_task_collate() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Dropout(0.9))
    ds = TensorImageDataset(torch.rand(5, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1]))
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=TASK.collate)
    a = TASK.evaluate(model, loader)
    b = TASK.evaluate(model, loader)
    assert a == b  # dropout off: eval mode
    with torch.no_grad():
        logits = model(ds.x)
    assert a == pytest.approx(TASK.score(logits.numpy(), ds.y.numpy()), rel=1e-6)


def test_split_slices_tensors_and_batch_len_counts() -> None:
    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    xm, ym = TASK.split(x, y, 1, 3)
    assert torch.equal(xm, x[1:3]) and torch.equal(ym, y[1:3])
    assert TASK.batch_len(x) == 5


def test_datasets_are_hpc_core_datas() -> None:
    train, val, info = TASK.build_datasets(DataConfig(source="digits", image_size=8))
    assert (info.num_classes, info.in_channels, info.image_size) == (10, 1, 8)
    assert len(train) + len(val) == 1797
    assert TASK.infer_info(train, val, None) == info
