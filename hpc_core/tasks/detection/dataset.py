"""A torch ``Dataset`` over a :class:`~.records.DetectionSet`, in torchvision's detection
convention, and the ``collate`` that batches it.

Each item is ``(image, target)``: ``image`` float32 CxHxW in [0, 1] (RGB), ``target``
``{"boxes": float32 (N, 4) xyxy pixels, "labels": int64 (N,)}``: what torchvision's detectors
(Faster R-CNN, RetinaNet, FCOS, SSD) take as is. A batch is two lists, since images may differ
in size and in their number of objects; a fixed ``size`` letterboxes every image instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from hpc_core.tasks.detection.records import DetectionSet
from hpc_core.tasks.detection.transforms import BoxTransform, Letterbox, Target


def load_image(path: str) -> torch.Tensor:
    """An image file as float32 3xHxW in [0, 1] (grey and RGBA made RGB)."""
    from PIL import Image

    with Image.open(path) as im:
        arr = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class DetectionDataset(Dataset):
    """Images and targets of ``dataset``; ``transform`` (seeded per item) then, when ``size``
    is set, a letterbox to ``size`` x ``size``.

    Crowd regions (COCO's ``iscrowd``) are left out of the targets unless ``keep_crowd``: a
    detector must not learn one box around a crowd, and the metric reads them from the
    records. ``label_offset`` is added to every label: 1 for torchvision's Faster R-CNN and
    SSD, which keep label 0 for the background. ``images`` holds the pixels in memory (uint8
    HxWx3, one per record, as :func:`~.synthetic.synthesize` makes them) instead of reading
    each record's file.
    """

    def __init__(
        self,
        dataset: DetectionSet,
        *,
        transform: BoxTransform | None = None,
        size: int | None = None,
        keep_crowd: bool = False,
        label_offset: int = 0,
        seed: int = 0,
        images: Sequence[np.ndarray] | None = None,
    ) -> None:
        if images is not None and len(images) != len(dataset.records):
            raise ValueError(f"{len(images)} images for {len(dataset.records)} records")
        self.dataset = dataset
        self.images = images
        self.transform = transform
        self.letterbox = Letterbox(size) if size else None
        self.keep_crowd = keep_crowd
        self.label_offset = label_offset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """New augmentations each epoch, the same ones for a given (seed, epoch, index)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset.records)

    def target(self, i: int) -> Target:
        """Image ``i``'s target as stored (before any transform)."""
        r = self.dataset.records[i]
        keep = np.ones(len(r.boxes), dtype=bool) if self.keep_crowd else ~r.iscrowd
        target = {"boxes": torch.from_numpy(r.boxes[keep].astype(np.float32)).reshape(-1, 4),
                  "labels": torch.from_numpy(r.labels[keep].astype(np.int64))
                  + self.label_offset}
        if self.keep_crowd:
            target["iscrowd"] = torch.from_numpy(r.iscrowd.astype(np.int64))
        return target

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Target]:
        if self.images is None:
            image = load_image(str(self.dataset.image_path(i)))
        else:
            image = torch.from_numpy(self.images[i]).permute(2, 0, 1).float().div(255.0)
            image = image.contiguous()
        target = self.target(i)
        # one generator per (seed, epoch, index): the same augmentation whichever worker or
        # rank loads the item, and again after a resume
        g = torch.Generator().manual_seed(hash((self.seed, self.epoch, i)) & (2**63 - 1))
        if self.transform is not None:
            image, target = self.transform(image, target, g)
        if self.letterbox is not None:
            image, target = self.letterbox(image, target, g)
        return image, target


def collate(batch: list[tuple[torch.Tensor, Target]]) -> tuple[list[torch.Tensor],
                                                               list[Target]]:
    """A ``DataLoader``'s ``collate_fn``: ``(images, targets)`` as two lists."""
    return [b[0] for b in batch], [b[1] for b in batch]
