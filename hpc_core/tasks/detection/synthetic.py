"""A synthetic detection set that needs no download: sklearn's bundled 8x8 digits, upscaled,
and three shapes, placed on textured backgrounds, optionally as a device's camera sees them.

Classes (13, in this order): ``digit_0`` .. ``digit_9``, ``square``, ``circle``,
``triangle``. Digits give the fine-grained part (a 3 and an 8 differ in a few strokes), shapes
the easy part. Each image holds 1 to 6 objects of 8 % to 35 % of the image's side, on noise,
a gradient or stripes; some overlap (at most 30 % of the smaller one is covered) and a quarter
touch an edge. Image ``i``'s first object is of class ``i mod 13``: every class appears in any
13 consecutive images. Image ``i`` depends only on (``seed``, ``i``, size, cameras, scenes): a
set of N images is the first N of a larger one.

:class:`Scenes` makes the set easier or harder: the classes drawn (a subset, e.g. the three
shapes, labelled ``0 .. K-1`` in the order given), the objects per image and their size range.
The defaults are the set described above, pixel for pixel.

Cameras (``cameras``) are the distortions of ``scripts/make_device_data.py``, applied to the
whole image, so a device's set is camera-shifted against the upstream one: ``invert`` (an IR
or backlit camera), ``noise`` (read noise, sigma 0.15), ``blur`` (a soft lens, 3x3 box),
``rotate`` (mounted 90 degrees off; boxes are rotated with the pixels, exactly).
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from hpc_core.cameras import KINDS, check_kinds, distort
from hpc_core.tasks.detection.coco import IMAGES_DIR, write_coco
from hpc_core.tasks.detection.records import DetectionSet, ImageRecord
from hpc_core.tasks.detection.yolo import write_yolo
from registry.atomic import TMP_PREFIX, fsync_dir, make_dirs, write_bytes_atomic

if TYPE_CHECKING:
    from hpc_core.tasks.detection.synthetic_config import SyntheticDetectionConfig

CLASS_NAMES = [f"digit_{d}" for d in range(10)] + ["square", "circle", "triangle"]
CAMERAS = KINDS
"""The device cameras (:mod:`hpc_core.cameras`) a set may be seen through."""
FORMATS = ("coco", "yolo")
MAX_OBJECTS = 6
MAX_COVERED = 0.3
"""At most this share of the smaller of two objects may lie under the other."""
MIN_SIDE_PX = 8
"""No object is drawn smaller than this many pixels a side (a digit needs its strokes)."""


@dataclass(frozen=True)
class Scenes:
    """What the images hold: the classes drawn (names of :data:`CLASS_NAMES`, labelled
    ``0 .. K-1`` in this order), ``objects`` per image (min, max; fewer when no free place is
    found) and each object's side as a share of the image's (min, max)."""

    classes: tuple[str, ...] = field(default_factory=lambda: tuple(CLASS_NAMES))
    objects: tuple[int, int] = (1, MAX_OBJECTS)
    object_size: tuple[float, float] = (0.08, 0.35)

    def __post_init__(self) -> None:
        unknown = [c for c in self.classes if c not in CLASS_NAMES]
        if unknown or not self.classes or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"classes {list(self.classes)}: give distinct names out of "
                             f"{', '.join(CLASS_NAMES)}")
        lo, hi = self.objects
        if not 1 <= lo <= hi:
            raise ValueError(f"objects {list(self.objects)}: need 1 <= min <= max")
        small, large = self.object_size
        if not 0 < small <= large <= 1:
            raise ValueError(f"object_size {list(self.object_size)}: need "
                             "0 < min <= max <= 1 (shares of the image side)")

    @classmethod
    def of(cls, cfg: SyntheticDetectionConfig) -> Scenes:
        """The scenes a training config's ``data.synthetic`` asks for (null classes: all)."""
        return cls(tuple(cfg.classes or CLASS_NAMES), cfg.objects, cfg.object_size)

    def sides(self, size: int) -> tuple[int, int]:
        """The smallest and largest object side in pixels on a ``size`` image."""
        lo = max(MIN_SIDE_PX, round(self.object_size[0] * size))
        return min(lo, size), min(size, max(lo, round(self.object_size[1] * size)))


DEFAULT_SCENES = Scenes()


@lru_cache(maxsize=1)
def _digits_by_class() -> list[np.ndarray]:
    from hpc_core.digits import digits_arrays

    images, labels = digits_arrays()
    scaled = images.astype(np.float32) / 16.0
    return [scaled[labels == k] for k in range(10)]


def _mask(label: int, side: int, rng: np.random.Generator) -> np.ndarray:
    """The object's alpha (side x side, [0, 1])."""
    if label < 10:
        glyphs = _digits_by_class()[label]
        glyph = torch.from_numpy(glyphs[rng.integers(len(glyphs))])[None, None]
        up = F.interpolate(glyph, size=(side, side), mode="bilinear", align_corners=False)
        return up[0, 0].clamp(0, 1).numpy()
    yy, xx = (np.mgrid[0:side, 0:side] + 0.5) / side
    if CLASS_NAMES[label] == "square":
        return np.ones((side, side), dtype=np.float32)
    if CLASS_NAMES[label] == "circle":
        return (((xx - 0.5) ** 2 + (yy - 0.5) ** 2) <= 0.25).astype(np.float32)
    # triangle: apex at the top centre, base along the bottom edge
    return (np.abs(xx - 0.5) <= yy / 2).astype(np.float32)


def _background(size: int, rng: np.random.Generator) -> np.ndarray:
    """A size x size x 3 texture in [0, 1]: low-frequency noise, a gradient or stripes."""
    kind = rng.integers(3)
    yy, xx = np.mgrid[0:size, 0:size] / size
    base = rng.uniform(0.2, 0.8, size=3)
    if kind == 0:
        coarse = torch.from_numpy(rng.uniform(-0.25, 0.25, size=(1, 3, 6, 6)).astype(np.float32))
        smooth = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
        tex = base[:, None, None] + smooth[0].numpy() + rng.normal(0, 0.03, (3, size, size))
    elif kind == 1:
        angle = rng.uniform(0, 2 * np.pi)
        ramp = np.cos(angle) * xx + np.sin(angle) * yy
        tex = base[:, None, None] + rng.uniform(-0.4, 0.4, size=3)[:, None, None] * ramp
    else:
        angle, period = rng.uniform(0, np.pi), rng.uniform(0.05, 0.2)
        wave = np.sin(2 * np.pi * (np.cos(angle) * xx + np.sin(angle) * yy) / period)
        tex = base[:, None, None] + rng.uniform(0.05, 0.2) * wave[None]
    return np.clip(tex, 0, 1).transpose(1, 2, 0).astype(np.float32)


def _covered(box: np.ndarray, placed: list[np.ndarray]) -> bool:
    for other in placed:
        iw = min(box[2], other[2]) - max(box[0], other[0])
        ih = min(box[3], other[3]) - max(box[1], other[1])
        if iw > 0 and ih > 0:
            smaller = min((box[2] - box[0]) * (box[3] - box[1]),
                          (other[2] - other[0]) * (other[3] - other[1]))
            if iw * ih > MAX_COVERED * smaller:
                return True
    return False


def _position(size: int, side: int, rng: np.random.Generator) -> int:
    if rng.random() < 0.25:  # against an edge: the border cases detectors get wrong
        return 0 if rng.random() < 0.5 else size - side
    return int(rng.integers(0, size - side + 1))


def render(index: int, size: int, seed: int, scenes: Scenes = DEFAULT_SCENES) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """Image ``index`` of the set ``seed``: (HxWx3 float32 [0, 1], boxes (N, 4) xyxy pixels,
    labels (N,), indices into ``scenes.classes``); boxes are the tight extent of each
    object's drawn pixels."""
    rng = np.random.default_rng([seed, index])
    image = _background(size, rng)
    k = len(scenes.classes)
    n = int(rng.integers(scenes.objects[0], scenes.objects[1] + 1))
    labels = [index % k, *rng.integers(0, k, n - 1)]
    small, large = scenes.sides(size)
    placed: list[np.ndarray] = []
    kept: list[int] = []
    for label in labels:
        side = int(rng.integers(small, large + 1))
        alpha = _mask(CLASS_NAMES.index(scenes.classes[int(label)]), side, rng)
        rows, cols = np.nonzero(alpha > 0.5)
        for _ in range(20):
            x, y = _position(size, side, rng), _position(size, side, rng)
            box = np.array([x + cols.min(), y + rows.min(), x + cols.max() + 1,
                            y + rows.max() + 1], dtype=np.float32)
            if not _covered(box, placed):
                break
        else:
            continue  # no free place: leave this object out
        region = image[y:y + side, x:x + side]
        bright = 0.15 if region.mean() > 0.5 else 0.85  # stand out from what is behind
        colour = np.clip(bright + rng.uniform(-0.15, 0.15, size=3), 0, 1)
        a = alpha[..., None]
        image[y:y + side, x:x + side] = region * (1 - a) + colour * a
        placed.append(box)
        kept.append(int(label))
    return image, np.stack(placed), np.array(kept, dtype=np.int64)


def apply_cameras(image: torch.Tensor, boxes: np.ndarray, cameras: Sequence[str],
                  g: torch.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """The camera distortions (:mod:`hpc_core.cameras`) on a CxHxW image, in order;
    ``rotate`` turns the boxes with the pixels."""
    for kind in cameras:
        image = distort(image, [kind], generator=g)
        if kind == "rotate":
            # rot90 turns pixel (row r, col c) of a W-wide image to (row W-1-c, col r)
            w = image.shape[-1]
            boxes = np.stack([boxes[:, 1], w - boxes[:, 2], boxes[:, 3], w - boxes[:, 0]],
                             axis=1).astype(np.float32)
    return image, boxes


def generate(n_images: int, size: int = 320, seed: int = 0, cameras: Sequence[str] = (),
             scenes: Scenes = DEFAULT_SCENES) -> Iterator[tuple[np.ndarray, ImageRecord]]:
    """The images (uint8 HxWx3) and their records one at a time (image ids 1 .. n, file names
    ``000000.png`` ..): a large set is written without holding it in memory."""
    check_kinds(cameras)
    for i in range(n_images):
        pixels, boxes, labels = render(i, size, seed, scenes)
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        chw, boxes = apply_cameras(torch.from_numpy(pixels).permute(2, 0, 1), boxes, cameras, g)
        yield ((chw.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8),
               ImageRecord(image_id=i + 1, file_name=f"{i:06d}.png", width=chw.shape[2],
                           height=chw.shape[1], boxes=boxes, labels=labels))


def synthesize(n_images: int, size: int = 320, seed: int = 0, cameras: Sequence[str] = (),
               scenes: Scenes = DEFAULT_SCENES) -> tuple[list[np.ndarray], DetectionSet]:
    """:func:`generate`'s images and records, all in memory; the set's ``images_dir`` is
    ``images`` (relative, until written)."""
    items = list(generate(n_images, size, seed, cameras, scenes))
    return ([p for p, _ in items],
            DetectionSet(Path(IMAGES_DIR), list(scenes.classes), [r for _, r in items]))


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def write_synthetic(out: Path, n_images: int, size: int = 320, seed: int = 0,
                    cameras: Sequence[str] = (), formats: Sequence[str] = ("coco",),
                    scenes: Scenes = DEFAULT_SCENES) -> Path:
    """Write the set to the folder ``out`` (which must not exist, or be empty) as COCO
    (``annotations.json``) and/or YOLO (``labels/``, ``data.yaml``), images in ``images/``.

    Built in a temporary folder beside ``out`` and renamed into place: ``out`` appears whole
    or not at all. Folders 0700, files 0600."""
    out = Path(out)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"format {unknown or formats!r}: use one or more of {', '.join(FORMATS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: choose a new --out "
                              "or remove it")
    check_kinds(cameras)
    make_dirs(out.parent)
    tmp = out.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{out.name}"
    try:
        images_dir = make_dirs(tmp / IMAGES_DIR)
        records = []
        for pixels, record in generate(n_images, size, seed, cameras, scenes):
            write_bytes_atomic(images_dir / record.file_name, _png(pixels))
            records.append(record)
        dataset = DetectionSet(images_dir, list(scenes.classes), records)
        if "coco" in formats:
            write_coco(tmp, dataset)
        if "yolo" in formats:
            write_yolo(tmp, dataset)
        os.replace(tmp, out)  # rename(2) replaces an empty folder too
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    fsync_dir(out.parent)
    return out
