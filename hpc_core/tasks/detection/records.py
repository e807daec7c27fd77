"""A loaded detection set, whatever format it came from: images and their boxes in the
project's convention (``xyxy`` pixels, contiguous labels), as the loaders return it and the
writers and the ``Dataset`` take it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ImageRecord:
    """One image and its objects."""

    image_id: int
    """The image's id: COCO's ``id``, or the image's position in a YOLO folder."""
    file_name: str
    """Path of the image file, relative to the set's ``images_dir``."""
    width: int
    height: int
    boxes: np.ndarray
    """float32 (N, 4), ``xyxy`` pixels, inside the image."""
    labels: np.ndarray
    """int64 (N,), indices into the set's ``class_names``."""
    iscrowd: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """bool (N,): COCO's crowd regions. Kept for the metric (a detection inside one is neither
    a hit nor a false positive), left out of training targets."""

    def __post_init__(self) -> None:
        n = len(self.boxes)
        if self.boxes.shape != (n, 4) or self.labels.shape != (n,):
            raise ValueError(f"image {self.image_id}: boxes {self.boxes.shape} and labels "
                             f"{self.labels.shape} disagree")
        if len(self.iscrowd) != n:
            object.__setattr__(self, "iscrowd", np.zeros(n, dtype=bool))


@dataclass(frozen=True)
class DetectionSet:
    """A detection data set: where its images are, its class names and its images' records."""

    images_dir: Path
    class_names: list[str]
    records: list[ImageRecord]
    category_ids: list[int] = field(default_factory=list)
    """COCO category id of each class index (``1 .. K`` when the source had none): what a
    COCO file written back, and the metric's ground truth, call each class."""

    def __post_init__(self) -> None:
        if not self.category_ids:
            object.__setattr__(self, "category_ids", list(range(1, len(self.class_names) + 1)))

    def image_path(self, i: int) -> Path:
        return self.images_dir / self.records[i].file_name
