"""The nms stand-in for torchvision's compiled operator: brute-force reference, and
torchvision's own kernel where it loads."""

from __future__ import annotations

import pytest
import torch

from hpc_core.vision import torchvision_ops
from hpc_core.vision.torchvision_ops import compiled_ops_missing, import_torchvision, nms_reference


def brute_force_nms(boxes: torch.Tensor, scores: torch.Tensor, thr: float) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))  # stable on ties
    keep: list[int] = []
    for i in order:
        ok = True
        for j in keep:
            a, b = boxes[i].tolist(), boxes[j].tolist()
            iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
            ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
            inter = iw * ih
            union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
            if union > 0 and inter / union > thr:
                ok = False
                break
        if ok:
            keep.append(i)
    return keep


def random_boxes(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 20
    wh = torch.rand(n, 2, generator=g) * 8
    scores = torch.rand(n, generator=g)
    return torch.cat([xy, xy + wh], 1), scores


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("thr", [0.0, 0.3, 0.7])
def test_nms_equals_brute_force(seed: int, thr: float) -> None:
    boxes, scores = random_boxes(40, seed)
    got = nms_reference(boxes, scores, thr)
    assert got.dtype == torch.int64
    assert got.tolist() == brute_force_nms(boxes, scores, thr)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_nms_in_blocks_of_rows_equals_brute_force(rows: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the IoU matrix is computed a block of rows at a time: blocks that split the boxes
    # anywhere give the same answer
    monkeypatch.setattr(torchvision_ops, "NMS_ROWS", rows)
    boxes, scores = random_boxes(60, 11)
    assert nms_reference(boxes, scores, 0.3).tolist() == brute_force_nms(boxes, scores, 0.3)


def test_nms_ties_zero_area_and_all_suppressed() -> None:
    boxes, scores = random_boxes(30, 7)
    scores = (scores * 4).round() / 4  # many equal scores: input order breaks the tie
    boxes[3] = torch.tensor([5.0, 5.0, 5.0, 9.0])  # zero area
    boxes[4] = torch.tensor([5.0, 5.0, 5.0, 9.0])
    assert nms_reference(boxes, scores, 0.5).tolist() == brute_force_nms(boxes, scores, 0.5)
    same = torch.tensor([[0.0, 0.0, 4.0, 4.0]]).repeat(5, 1)
    s = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.2])
    assert nms_reference(same, s, 0.5).tolist() == [1]  # the first of the tied best
    assert nms_reference(torch.empty(0, 4), torch.empty(0), 0.5).tolist() == []


def test_torchvision_nms_goes_through_the_entry() -> None:
    tv = import_torchvision()
    boxes, scores = random_boxes(50, 3)
    assert tv.ops.nms(boxes, scores, 0.4).tolist() == brute_force_nms(boxes, scores, 0.4)
    idx = torch.randint(0, 3, (50,), generator=torch.Generator().manual_seed(1))
    kept = tv.ops.batched_nms(boxes, scores, idx, 0.4).tolist()
    for c in range(3):  # per class: nms within the class only
        members = [i for i in range(50) if idx[i] == c]
        want = [members[i] for i in brute_force_nms(boxes[members], scores[members], 0.4)]
        assert sorted(i for i in kept if idx[i] == c) == sorted(want)


def test_qnms_refused_clearly_without_compiled_ops() -> None:
    import_torchvision()
    if compiled_ops_missing() is None:
        pytest.skip("torchvision's compiled operators load here: qnms is torchvision's own")
    with pytest.raises(RuntimeError, match=r"qnms.*compiled operators"):
        torch.ops.torchvision.qnms(torch.zeros(1, 4), torch.zeros(1), 0.5)


def test_nms_equals_torchvision_compiled_kernel() -> None:
    import_torchvision()
    if compiled_ops_missing() is not None:
        pytest.skip(f"torchvision's compiled nms is not available: {compiled_ops_missing()}")
    for seed in range(5):
        boxes, scores = random_boxes(60, seed)
        want = torch.ops.torchvision.nms(boxes, scores, 0.5)
        assert torch.equal(nms_reference(boxes, scores, 0.5), want)
