"""A detection config's data sets: the synthetic set in memory, COCO and YOLO folders whole or
by split; labels shifted for torchvision's background, crowds kept for the metric only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_core.config import ConfigError, DataConfig, config_from_dict
from hpc_core.tasks.detection.boxes import DetectionDataError
from hpc_core.tasks.detection.dataset import load_image
from hpc_core.tasks.detection.sources import LABEL_OFFSET, build_detection_datasets
from hpc_core.tasks.detection.synthetic import CLASS_NAMES, Scenes, synthesize, write_synthetic

from .conftest import coco_tree


def test_synthetic_set_in_memory_is_the_written_one(tmp_path: Path) -> None:
    cfg = DataConfig(source="synthetic_detection", val_fraction=0.3,
                     synthetic={"images": 10, "size": 64, "seed": 3})
    train, val, info = build_detection_datasets(cfg)
    assert (len(train), len(val)) == (7, 3)
    assert (info.num_classes, info.in_channels, info.image_size) == (len(CLASS_NAMES) + 1, 3, 64)
    folder = write_synthetic(tmp_path / "det", 10, size=64, seed=3)
    _, drawn = synthesize(10, 64, 3)
    for ds in (train, val):
        for i, record in enumerate(ds.dataset.records):
            image, target = ds[i]
            assert torch.equal(image, load_image(str(folder / "images" / record.file_name)))
            assert torch.equal(target["labels"], torch.from_numpy(record.labels) + LABEL_OFFSET)
            assert np.array_equal(record.boxes, drawn.records[record.image_id - 1].boxes)


def test_synthetic_scenes_come_from_the_config() -> None:
    cfg = DataConfig(source="synthetic_detection", val_fraction=0.25, synthetic={
        "images": 8, "size": 64, "seed": 2, "classes": ["circle", "digit_7"],
        "objects": [2, 2], "object_size": [0.2, 0.3]})
    train, val, info = build_detection_datasets(cfg)
    assert info.num_classes == 2 + LABEL_OFFSET
    assert train.dataset.class_names == val.dataset.class_names == ["circle", "digit_7"]
    _, drawn = synthesize(8, 64, 2, scenes=Scenes(("circle", "digit_7"), (2, 2), (0.2, 0.3)))
    for record in train.dataset.records + val.dataset.records:
        want = drawn.records[record.image_id - 1]
        assert np.array_equal(record.boxes, want.boxes)
        assert np.array_equal(record.labels, want.labels)


@pytest.mark.parametrize(("synthetic", "match"), [
    ({"classes": ["circle", "circle"]}, r"data.synthetic: classes .*: a class is listed twice"),
    ({"classes": ["hexagon"]}, r"data.synthetic.classes.0.*'digit_0'"),
    ({"classes": []}, r"data.synthetic.classes"),
    ({"objects": [4, 2]}, r"data.synthetic: objects \[4, 2\]: need 1 <= min <= max <= 20"),
    ({"object_size": [0.3, 1.5]}, r"data.synthetic: object_size .*0 < min <= max <= 1"),
])
def test_bad_synthetic_scenes_are_refused_naming_the_field(synthetic: dict[str, object],
                                                           match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"task": "detection", "training": {"max_steps": 1},
                          "data": {"source": "synthetic_detection", "synthetic": synthetic}})


def test_letterbox_and_split_seed(tmp_path: Path) -> None:
    cfg = DataConfig(source="synthetic_detection", image_size=48, synthetic={"images": 6,
                                                                            "size": 64})
    train, _, info = build_detection_datasets(cfg)
    assert info.image_size == 48 and train[0][0].shape == (3, 48, 48)
    other, _, _ = build_detection_datasets(cfg.model_copy(update={"split_seed": 1}))
    assert ([r.image_id for r in train.dataset.records]
            != [r.image_id for r in other.dataset.records])


def test_coco_folder_holds_out_a_fraction_and_keeps_crowds_for_the_metric(coco_folder) -> None:
    folder = coco_folder()
    seen = set()
    for seed in range(8):  # until image 1 (with a crowd) has been in each split
        cfg = DataConfig(source="coco", path=folder, val_fraction=0.5, split_seed=seed)
        train, val, info = build_detection_datasets(cfg)
        assert (len(train), len(val), info.num_classes) == (1, 1, 3)
        assert info.image_size == max(max(r.width, r.height) for r in train.dataset.records)
        for name, ds in (("train", train), ("val", val)):
            if ds.dataset.records[0].image_id != 1:
                continue
            seen.add(name)
            _, target = ds[0]
            if name == "train":  # a crowd is no training target
                # category 3 is class 0 (ids in order), 1 for the model
                assert "iscrowd" not in target and target["labels"].tolist() == [1]
            else:  # the metric needs it
                assert target["iscrowd"].tolist() == [0, 1]
    assert seen == {"train", "val"}


def test_coco_and_yolo_splits(tmp_path: Path, coco_folder) -> None:
    # A COCO folder laid out by split: annotations/instances_SPLIT.json, images/SPLIT/
    flat = coco_folder()
    folder = tmp_path / "split"
    for split in ("train", "val"):
        shutil.copytree(flat / "images", folder / "images" / split)
        (folder / "annotations").mkdir(parents=True, exist_ok=True)
        shutil.copy(flat / "annotations.json", folder / "annotations" / f"instances_{split}.json")
    cfg = DataConfig(source="coco", path=folder, split="train", val_split="val")
    train, val, _ = build_detection_datasets(cfg)
    assert (len(train), len(val)) == (2, 2)
    with pytest.raises(DetectionDataError, match=r"data.split/val_split 'test': no .*"
                       r"instances_test\.json"):
        build_detection_datasets(cfg.model_copy(update={"val_split": "test"}))
    # A class list that differs between the parts is refused
    tree = json.loads((flat / "annotations.json").read_text())
    tree["categories"][0]["name"] = "disc"
    (folder / "annotations" / "instances_val.json").write_text(json.dumps(tree))
    with pytest.raises(DetectionDataError, match="must be the same list"):
        build_detection_datasets(cfg)
    # YOLO by split
    out = write_synthetic(tmp_path / "y", 6, size=32, formats=("yolo",))
    yolo = tmp_path / "yolo-split"
    for split in ("train", "val"):
        for sub in ("images", "labels"):
            shutil.copytree(out / sub, yolo / sub / split)
    shutil.copy(out / "data.yaml", yolo / "data.yaml")
    ycfg = DataConfig(source="yolo", path=yolo, split="train", val_split="val")
    ytrain, yval, yinfo = build_detection_datasets(ycfg)
    assert (len(ytrain), len(yval), yinfo.num_classes) == (6, 6, len(CLASS_NAMES) + 1)


def test_boxes_outside_the_image_refused_or_clipped(coco_folder) -> None:
    tree = coco_tree()
    tree["annotations"][0]["bbox"] = [80, 20, 40, 40]  # 20 px past a 100 px wide image
    folder = coco_folder(tree)
    with pytest.raises(DetectionDataError, match="on_outside='clip'"):
        build_detection_datasets(DataConfig(source="coco", path=folder))
    train, val, _ = build_detection_datasets(DataConfig(source="coco", path=folder,
                                                        boxes_outside="clip"))
    boxes = [b for ds in (train, val) for r in ds.dataset.records for b in r.boxes.tolist()]
    assert [80.0, 20.0, 100.0, 60.0] in boxes
