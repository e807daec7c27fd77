"""The round trip a training run makes: synthetic set -> COCO folder -> Dataset -> DataLoader
with ``collate``, in torchvision's detection convention."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hpc_core.tasks.detection.coco import load_coco
from hpc_core.tasks.detection.dataset import DetectionDataset, collate
from hpc_core.tasks.detection.metrics import evaluate_detections
from hpc_core.tasks.detection.synthetic import synthesize, write_synthetic
from hpc_core.tasks.detection.transforms import Compose, HorizontalFlip, RandomResizedCrop

from .conftest import coco_tree


@pytest.fixture(scope="module")
def det_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("det") / "set", 5, 80, seed=1)


def test_synthetic_to_coco_to_dataset_to_batches(det_folder: Path) -> None:
    ds = DetectionDataset(load_coco(det_folder))
    pixels, expected = synthesize(5, 80, seed=1)
    image, target = ds[0]
    assert image.dtype == torch.float32 and image.shape == (3, 80, 80)
    assert image.min() >= 0 and image.max() <= 1
    # the pixels are the generator's, through PNG, losslessly
    assert torch.equal((image * 255).round().to(torch.uint8).permute(1, 2, 0),
                       torch.from_numpy(pixels[0]))
    assert target["boxes"].dtype == torch.float32 and target["labels"].dtype == torch.int64
    np.testing.assert_array_equal(target["boxes"].numpy(), expected.records[0].boxes)
    loader = DataLoader(ds, batch_size=2, collate_fn=collate)
    batches = list(loader)
    assert [len(images) for images, _ in batches] == [2, 2, 1]
    images, targets = batches[0]
    assert isinstance(images, list) and isinstance(targets, list)
    assert set(targets[1]) == {"boxes", "labels"}
    # the targets as predictions score a perfect mAP: what the metric reads is what the
    # dataset gives
    all_targets = [t for _, ts in batches for t in ts]
    preds = [{**t, "scores": torch.ones(len(t["labels"]))} for t in all_targets]
    m = evaluate_detections(preds, all_targets, ds.dataset.class_names)
    assert m.map == pytest.approx(1.0)


def test_augmented_and_letterboxed_items_are_seeded_per_epoch(det_folder: Path) -> None:
    t = Compose([HorizontalFlip(), RandomResizedCrop(64, scale=(0.5, 1.0))])
    ds = DetectionDataset(load_coco(det_folder), transform=t, size=72, seed=7)
    a_image, a = ds[2]
    assert a_image.shape == (3, 72, 72)
    assert (a["boxes"] >= 0).all() and (a["boxes"] <= 72).all()
    b_image, _ = DetectionDataset(load_coco(det_folder), transform=t, size=72, seed=7)[2]
    assert torch.equal(a_image, b_image)
    ds.set_epoch(1)
    assert not torch.equal(ds[2][0], a_image)


def test_crowd_regions_stay_out_of_training_targets(coco_folder) -> None:
    d = load_coco(coco_folder(coco_tree()))
    _, target = DetectionDataset(d)[0]
    assert target["labels"].tolist() == [0]  # the crowd annotation (circle) left out
    _, kept = DetectionDataset(d, keep_crowd=True, label_offset=1)[0]
    assert kept["labels"].tolist() == [1, 2] and kept["iscrowd"].tolist() == [0, 1]
