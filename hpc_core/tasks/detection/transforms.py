"""Augmentations that move boxes with pixels: pure torch, seeded by the caller's generator.

Each transform is called as ``t(image, target, g)`` with ``image`` float32 CxHxW in [0, 1],
``target`` ``{"boxes": (N, 4) xyxy pixels, "labels": (N,), ...}`` and ``g`` a
``torch.Generator``; it returns the new image and target. Geometric ones move, clip and drop
boxes (every per-object entry of the target alike); photometric ones leave boxes alone.
Randomness comes only from ``g``: the ``Dataset`` seeds one per (seed, epoch, index), so a run
sees the same augmentations on every rank and after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

Target = dict[str, torch.Tensor]


class BoxTransform(Protocol):
    def __call__(
        self, image: torch.Tensor, target: Target, g: torch.Generator
    ) -> tuple[torch.Tensor, Target]: ...


def _uniform(g: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=g))


def _keep(target: Target, keep: torch.Tensor) -> Target:
    """Keep the objects where ``keep`` is true, in every per-object entry of ``target``."""
    n = len(target["boxes"])
    return {k: (v[keep] if v.ndim >= 1 and len(v) == n else v) for k, v in target.items()}


def resize(image: torch.Tensor, target: Target, height: int, width: int) -> tuple[
        torch.Tensor, Target]:
    """Resize to ``height`` x ``width`` (bilinear, antialiased); boxes scale with the pixels."""
    _, h, w = image.shape
    out = F.interpolate(image[None], size=(height, width), mode="bilinear",
                        align_corners=False, antialias=True)[0].clamp(0, 1)
    scale = torch.tensor([width / w, height / h, width / w, height / h])
    return out, {**target, "boxes": target["boxes"] * scale}


@dataclass(frozen=True)
class LetterboxInfo:
    """How :func:`letterbox` mapped the original image: scaled by ``scale_x``, ``scale_y`` (the
    same ratio but for the rounding of the new size), then shifted by ``pad_x``, ``pad_y``."""

    scale_x: float
    scale_y: float
    pad_x: int
    pad_y: int

    def unmap(self, boxes: torch.Tensor) -> torch.Tensor:
        """Boxes in the letterboxed image (a detector's output) back in the original's pixels."""
        offset = torch.tensor([self.pad_x, self.pad_y, self.pad_x, self.pad_y],
                              dtype=boxes.dtype)
        scale = torch.tensor([self.scale_x, self.scale_y, self.scale_x, self.scale_y],
                             dtype=boxes.dtype)
        return (boxes - offset) / scale


def letterbox(image: torch.Tensor, target: Target, size: int, fill: float = 0.5) -> tuple[
        torch.Tensor, Target, LetterboxInfo]:
    """Fit the image in a ``size`` x ``size`` square keeping its aspect ratio, centred on a
    ``fill`` grey border (YOLO's letterbox); boxes move with the pixels."""
    c, h, w = image.shape
    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    resized, target = resize(image, target, nh, nw)
    pad_x, pad_y = (size - nw) // 2, (size - nh) // 2
    out = torch.full((c, size, size), fill, dtype=image.dtype)
    out[:, pad_y:pad_y + nh, pad_x:pad_x + nw] = resized
    boxes = target["boxes"] + torch.tensor([pad_x, pad_y, pad_x, pad_y], dtype=torch.float32)
    # the scales of the resize as done (rounded sizes), so unmap inverts it exactly
    return out, {**target, "boxes": boxes}, LetterboxInfo(nw / w, nh / h, pad_x, pad_y)


@dataclass(frozen=True)
class Letterbox:
    """:func:`letterbox` as a transform: every image ``size`` x ``size``."""

    size: int
    fill: float = 0.5

    def __call__(self, image: torch.Tensor, target: Target, g: torch.Generator) -> tuple[
            torch.Tensor, Target]:
        image, target, _ = letterbox(image, target, self.size, self.fill)
        return image, target


@dataclass(frozen=True)
class HorizontalFlip:
    """Mirror left-right with probability ``p``."""

    p: float = 0.5

    def __call__(self, image: torch.Tensor, target: Target, g: torch.Generator) -> tuple[
            torch.Tensor, Target]:
        if float(torch.rand((), generator=g)) >= self.p:
            return image, target
        w = image.shape[-1]
        b = target["boxes"]
        flipped = torch.stack([w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]], dim=1)
        return image.flip(-1), {**target, "boxes": flipped}


def crop(image: torch.Tensor, target: Target, top: int, left: int, height: int, width: int,
         min_visible: float) -> tuple[torch.Tensor, Target]:
    """Cut the ``height`` x ``width`` window at (``top``, ``left``); boxes are clipped to it and
    dropped when less than ``min_visible`` of their area (or under a pixel a side) is left."""
    b = target["boxes"] - torch.tensor([left, top, left, top], dtype=torch.float32)
    clipped = torch.stack([b[:, 0].clamp(0, width), b[:, 1].clamp(0, height),
                           b[:, 2].clamp(0, width), b[:, 3].clamp(0, height)], dim=1)
    wh = clipped[:, 2:] - clipped[:, :2]
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    keep = (wh >= 1).all(dim=1) & (wh.prod(dim=1) >= min_visible * area)
    out = image[:, top:top + height, left:left + width]
    return out, _keep({**target, "boxes": clipped}, keep)


@dataclass(frozen=True)
class RandomResizedCrop:
    """A random window of ``scale`` of the image's area and aspect ratio in ``ratio`` (log-
    uniform), resized to ``size`` x ``size``; objects less than ``min_visible`` inside go."""

    size: int
    scale: tuple[float, float] = (0.3, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    min_visible: float = 0.3
    tries: int = 10

    def _window(self, h: int, w: int, g: torch.Generator) -> tuple[int, int, int, int]:
        for _ in range(self.tries):
            area = h * w * _uniform(g, *self.scale)
            aspect = math.exp(_uniform(g, math.log(self.ratio[0]), math.log(self.ratio[1])))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                top = int(torch.randint(0, h - ch + 1, (), generator=g))
                left = int(torch.randint(0, w - cw + 1, (), generator=g))
                return top, left, ch, cw
        return 0, 0, h, w  # no window fits the ranges: the whole image

    def __call__(self, image: torch.Tensor, target: Target, g: torch.Generator) -> tuple[
            torch.Tensor, Target]:
        top, left, ch, cw = self._window(image.shape[1], image.shape[2], g)
        image, target = crop(image, target, top, left, ch, cw, self.min_visible)
        return resize(image, target, self.size, self.size)


@dataclass(frozen=True)
class ScaleJitter:
    """Resize by a random factor in ``scale`` (aspect kept): objects seen at other sizes."""

    scale: tuple[float, float] = (0.75, 1.25)

    def __call__(self, image: torch.Tensor, target: Target, g: torch.Generator) -> tuple[
            torch.Tensor, Target]:
        s = _uniform(g, *self.scale)
        _, h, w = image.shape
        return resize(image, target, max(1, round(h * s)), max(1, round(w * s)))


@dataclass(frozen=True)
class PhotometricJitter:
    """Brightness (a factor in ``1 ± brightness``) and contrast (blend with the image's mean
    grey, a factor in ``1 ± contrast``); boxes unchanged."""

    brightness: float = 0.2
    contrast: float = 0.2

    def __call__(self, image: torch.Tensor, target: Target, g: torch.Generator) -> tuple[
            torch.Tensor, Target]:
        b = _uniform(g, 1 - self.brightness, 1 + self.brightness)
        c = _uniform(g, 1 - self.contrast, 1 + self.contrast)
        bright = image * b
        mean = bright.mean()
        return ((bright - mean) * c + mean).clamp(0, 1), target


@dataclass(frozen=True)
class GaussianNoise:
    """Additive sensor noise of standard deviation ``sigma``; boxes unchanged."""

    sigma: float = 0.03

    def __call__(self, image: torch.Tensor, target: Target, g: torch.Generator) -> tuple[
            torch.Tensor, Target]:
        noise = torch.randn(image.shape, generator=g) * self.sigma
        return (image + noise).clamp(0, 1), target


@dataclass(frozen=True)
class Compose:
    """The transforms in order, sharing one generator."""

    transforms: Sequence[BoxTransform]

    def __call__(self, image: torch.Tensor, target: Target, g: torch.Generator) -> tuple[
            torch.Tensor, Target]:
        for t in self.transforms:
            image, target = t(image, target, g)
        return image, target
