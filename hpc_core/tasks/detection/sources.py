"""A detection config's data: the train and validation ``Dataset`` of a COCO folder, a YOLO
folder or the synthetic set (``data.source``), checked when loaded.

Labels reach the model shifted by :data:`LABEL_OFFSET`: torchvision's detectors keep label 0
for the background, so the set's classes ``0 .. K-1`` are ``1 .. K`` and the model has
``K + 1`` classes. The validation split keeps COCO's crowd regions for the metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from hpc_core.config import DataConfig
from hpc_core.data import DataInfo, split_indices
from hpc_core.tasks.detection.boxes import DetectionDataError
from hpc_core.tasks.detection.coco import IMAGES_DIR, load_coco
from hpc_core.tasks.detection.dataset import DetectionDataset
from hpc_core.tasks.detection.records import DetectionSet
from hpc_core.tasks.detection.synthetic import Scenes, synthesize
from hpc_core.tasks.detection.synthetic_config import SyntheticDetectionConfig
from hpc_core.tasks.detection.yolo import load_yolo

LABEL_OFFSET = 1
"""Added to every label on its way to the model (label 0 is torchvision's background)."""


@dataclass(frozen=True)
class Part:
    """A loaded set, with its pixels when they are in memory (the synthetic set)."""

    dataset: DetectionSet
    images: list[np.ndarray] | None = None

    def subset(self, idx: list[int]) -> Part:
        d = self.dataset
        return Part(DetectionSet(d.images_dir, d.class_names, [d.records[i] for i in idx],
                                 d.category_ids),
                    None if self.images is None else [self.images[i] for i in idx])


def _coco_split(folder: Path, split: str, cfg: DataConfig) -> DetectionSet:
    annotations = folder / "annotations" / f"instances_{split}.json"
    if not annotations.is_file():
        raise DetectionDataError(str(folder), [
            f"data.split/val_split {split!r}: no {annotations}: name the file "
            f"instances_{split}.json, or fix the split"])
    for images_dir in (folder / IMAGES_DIR / split, folder / split, folder / IMAGES_DIR):
        if images_dir.is_dir():
            break
    return load_coco(folder, annotations=annotations, images_dir=images_dir,
                     on_outside=cfg.boxes_outside)


def load_part(cfg: DataConfig, split: str | None) -> Part:
    """The set ``cfg`` names (``split``: the folder's part, None the whole folder)."""
    if cfg.source == "synthetic_detection":
        s = cfg.synthetic or SyntheticDetectionConfig()
        pixels, dataset = synthesize(s.images, s.size, s.seed, s.cameras, Scenes.of(s))
        return Part(dataset, pixels)
    assert cfg.path is not None  # DataConfig requires it for coco and yolo
    if cfg.source == "yolo":
        return Part(load_yolo(cfg.path, split=split, on_outside=cfg.boxes_outside))
    if cfg.source == "coco":
        if split is None:
            return Part(load_coco(cfg.path, on_outside=cfg.boxes_outside))
        return Part(_coco_split(cfg.path, split, cfg))
    raise ValueError(f"data.source={cfg.source!r} is not detection data: use coco, yolo or "
                     "synthetic_detection")


def _dataset(part: Part, cfg: DataConfig, *, keep_crowd: bool) -> DetectionDataset:
    return DetectionDataset(part.dataset, size=cfg.image_size, keep_crowd=keep_crowd,
                            label_offset=LABEL_OFFSET, images=part.images)


def build_detection_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    """Train and validation splits: ``data.val_split`` when set, else ``data.val_fraction``
    of the training part held out by ``data.split_seed``."""
    train = load_part(cfg, cfg.split)
    if cfg.val_split is not None:
        val = load_part(cfg, cfg.val_split)
        if val.dataset.class_names != train.dataset.class_names:
            raise DetectionDataError(str(cfg.path), [
                f"data.val_split {cfg.val_split!r} has the classes {val.dataset.class_names}, "
                f"the training part {train.dataset.class_names}: they must be the same list"])
    else:
        train_idx, val_idx = split_indices(len(train.dataset.records), cfg.val_fraction,
                                           cfg.split_seed)
        train, val = train.subset(train_idx), train.subset(val_idx)
    if not train.dataset.records or not val.dataset.records:
        raise DetectionDataError(str(cfg.path or cfg.source), [
            f"{len(train.dataset.records)} training and {len(val.dataset.records)} validation "
            "images: each split needs at least one"])
    sides = [max(r.width, r.height) for r in train.dataset.records]
    info = DataInfo(
        num_classes=len(train.dataset.class_names) + LABEL_OFFSET,
        in_channels=3,
        image_size=cfg.image_size or max(sides),
        num_train=len(train.dataset.records),
        num_val=len(val.dataset.records),
    )
    return (_dataset(train, cfg, keep_crowd=False), _dataset(val, cfg, keep_crowd=True), info)
