"""The detection task against references: its loss is the sum of torchvision's loss dict, its
accumulator's mAP is pycocotools' own on a hand-made case (also split over batches and over
two DDP ranks), and the numpy scorer agrees."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hpc_core.tasks import get_task
from hpc_core.tasks.detection.task import DetectionTask
from hpc_core.vision.builders import resolve

TASK = get_task("detection")


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 4)


# Labels as the model sees them (1 .. K; 0 is torchvision's background).
TARGETS = [
    {"boxes": t([[10, 10, 50, 50], [60, 60, 90, 100]]), "labels": torch.tensor([1, 2])},
    # a crowd region: a detection inside it is neither a hit nor a false positive
    {"boxes": t([[5, 5, 30, 30], [40, 40, 100, 100]]), "labels": torch.tensor([1, 1]),
     "iscrowd": torch.tensor([0, 1])},
    {"boxes": t([[0, 0, 20, 40]]), "labels": torch.tensor([3])},
]
PREDICTIONS = [
    {"boxes": t([[12, 10, 50, 52], [0, 0, 20, 20], [60, 62, 90, 100]]),
     "scores": torch.tensor([0.9, 0.8, 0.6]), "labels": torch.tensor([1, 2, 2])},
    {"boxes": t([[5, 5, 30, 31], [50, 50, 70, 70]]), "scores": torch.tensor([0.7, 0.95]),
     "labels": torch.tensor([1, 1])},
    {"boxes": t([[2, 0, 20, 30]]), "scores": torch.tensor([0.5]), "labels": torch.tensor([3])},
]


def pycocotools_reference(predictions: list[dict], targets: list[dict]) -> tuple[float, float]:
    """mAP@0.5:0.95 and mAP@0.5 straight from pycocotools (COCO's own xywh, loadRes)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(b: list[float]) -> list[float]:
        return [b[0], b[1], b[2] - b[0], b[3] - b[1]]

    images, anns, dets = [], [], []
    for i, (p, g) in enumerate(zip(predictions, targets, strict=True), start=1):
        images.append({"id": i, "width": 200, "height": 200})
        crowd = g.get("iscrowd", torch.zeros(len(g["labels"]))).tolist()
        for box, label, c in zip(g["boxes"].tolist(), g["labels"].tolist(), crowd, strict=True):
            w = xywh(box)
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": label, "bbox": w,
                         "area": w[2] * w[3], "iscrowd": int(c)})
        for box, s, label in zip(p["boxes"].tolist(), p["scores"].tolist(),
                                 p["labels"].tolist(), strict=True):
            dets.append({"image_id": i, "category_id": label, "bbox": xywh(box), "score": s})
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": images, "annotations": anns,
                      "categories": [{"id": k} for k in (1, 2, 3)]}
        gt.createIndex()
        ev = COCOeval(gt, gt.loadRes(dets), iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[0]), float(ev.stats[1])


def test_accumulator_equals_pycocotools_over_uneven_batches() -> None:
    ev = TASK.new_evaluation()
    ev.add(PREDICTIONS[:2], TARGETS[:2])
    ev.add(PREDICTIONS[2:], TARGETS[2:])
    out = ev.result()
    ref_map, ref_map50 = pycocotools_reference(PREDICTIONS, TARGETS)
    assert 0 < out["map"] < 1 and 0 < out["map50"] <= 1  # a case with partial credit
    assert out["map"] == pytest.approx(ref_map, abs=1e-12)
    assert out["map50"] == pytest.approx(ref_map50, abs=1e-12)
    assert set(out) == set(TASK.spec.metrics)


def test_numpy_score_equals_the_accumulator() -> None:
    ev = TASK.new_evaluation()
    ev.add(PREDICTIONS, TARGETS)
    as_numpy = [{k: v.numpy() for k, v in d.items()} for d in PREDICTIONS]
    targets = [{k: v.numpy() for k, v in d.items()} for d in TARGETS]
    assert TASK.score(as_numpy, targets) == ev.result()


def test_perfect_empty_and_undefined_cases() -> None:
    perfect = [dict(g, scores=torch.ones(len(g["labels"]))) for g in TARGETS]
    out = TASK.score(perfect, TARGETS)
    assert out["map"] == pytest.approx(1.0) and out["map50"] == pytest.approx(1.0)
    nothing = [{"boxes": torch.zeros(0, 4), "scores": torch.zeros(0),
                "labels": torch.zeros(0, dtype=torch.int64)} for _ in TARGETS]
    assert TASK.score(nothing, TARGETS)["map"] == 0.0
    no_truth = [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}]
    result = TASK.score(nothing[:1], no_truth)
    assert math.isnan(result["map"]) and not TASK.passes(result["map"])
    assert all(math.isnan(v) for v in TASK.score([], []).values())
    with pytest.raises(ValueError, match="2 predictions for 3 images"):
        TASK.score(PREDICTIONS[:2], TARGETS)


def _detector() -> nn.Module:
    torch.manual_seed(0)
    return resolve("torchvision/retinanet_resnet18_fpn")(num_classes=4, in_channels=3,
                                                          image_size=64)


def test_loss_is_the_sum_of_torchvisions_loss_dict() -> None:
    model = _detector().train()
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 64, 64, generator=g), torch.rand(3, 48, 64, generator=g)]
    targets = [{"boxes": t([[4, 4, 30, 40]]), "labels": torch.tensor([1])},
               {"boxes": t([[10, 5, 60, 20], [0, 0, 8, 8]]), "labels": torch.tensor([3, 2])}]
    loss = TASK.loss(model, images, targets)
    with torch.no_grad():
        parts = model(images, targets)
    assert set(parts) == {"classification", "bbox_regression"}
    assert loss.dim() == 0 and loss.requires_grad
    assert float(loss.detach()) == pytest.approx(float(sum(parts.values())), rel=1e-6)
    model.eval()
    with torch.no_grad():
        out = TASK.predict(model, images)
    assert len(out) == 2 and set(out[0]) == {"boxes", "scores", "labels"}

    class Classifier(nn.Module):
        def forward(self, images: list, targets: list) -> torch.Tensor:
            return torch.zeros(len(images), 4)

    with pytest.raises(TypeError, match="returned Tensor in train mode, not its loss dict"):
        TASK.loss(Classifier(), images, targets)


def test_split_slices_lists_and_to_device_moves_targets() -> None:
    images = [torch.zeros(3, 4, 4) for _ in range(5)]
    xm, ym = TASK.split(images, TARGETS * 2, 1, 4)
    assert len(xm) == 3 and ym[0] is TARGETS[1] and TASK.batch_len(xm) == 3
    _, moved = TASK.to_device(xm, ym, torch.device("cpu"))
    assert [sorted(m) for m in moved] == [sorted(g) for g in ym]
    assert torch.equal(moved[0]["iscrowd"], TARGETS[1]["iscrowd"])


RANK_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from hpc_core.distributed import DistInfo
from hpc_core.tasks import get_task
rank, world = int(sys.argv[1]), 2
case = json.load(open(sys.argv[4]))
preds, targets = ([{k: torch.tensor(v) for k, v in d.items()} for d in case[key]]
                  for key in ("predictions", "targets"))
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank,
                        world_size=world)
ev = get_task("detection").new_evaluation(DistInfo(rank, world, 0, torch.device("cpu")))
ev.add(preds[rank::world], targets[rank::world])   # eval_shard's split
json.dump(ev.result(), open(sys.argv[3], "w"))
dist.destroy_process_group()
"""


def test_ranks_gather_detections_and_score_the_whole_set(
        tmp_path: Path, python: str, subprocess_env: dict[str, str]) -> None:
    script, case = tmp_path / "rank.py", tmp_path / "case.json"
    script.write_text(RANK_SCRIPT)
    case.write_text(json.dumps({
        "predictions": [{k: v.tolist() for k, v in d.items()} for d in PREDICTIONS],
        "targets": [{k: v.tolist() for k, v in d.items()} for d in TARGETS]}))
    procs = [subprocess.Popen([python, str(script), str(r), str(tmp_path / "store"),
                               str(tmp_path / f"out{r}.json"), str(case)], env=subprocess_env)
             for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    single = TASK.score(PREDICTIONS, TARGETS)
    for r in range(2):
        got = json.loads((tmp_path / f"out{r}.json").read_text())
        assert got == pytest.approx(single, abs=1e-12), f"rank {r}"


def test_detection_task_is_the_registered_one() -> None:
    assert isinstance(TASK, DetectionTask) and TASK.gate_metric == "map"
    assert np.isfinite(TASK.score(PREDICTIONS, TARGETS)["ar100"])


def test_info_of_data_sets_handed_in() -> None:
    from hpc_core.config import DataConfig
    from hpc_core.tasks.detection.sources import build_detection_datasets

    cfg = DataConfig(source="synthetic_detection", synthetic={"images": 20, "size": 64},
                     val_fraction=0.2)
    train, val, info = build_detection_datasets(cfg)
    assert TASK.infer_info(train, val, None) == info  # this split holds every class
    assert TASK.infer_info(train, val, 30).num_classes == 30
