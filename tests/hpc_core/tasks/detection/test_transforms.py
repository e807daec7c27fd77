"""Augmentations move boxes with pixels: each object is drawn as a filled rectangle in a
channel of its own, and after the transform the pixels lit in that channel lie exactly under
the object's new box (within a pixel where interpolation softens the edges)."""

from __future__ import annotations

import pytest
import torch

from hpc_core.tasks.detection.transforms import (
    Compose,
    GaussianNoise,
    HorizontalFlip,
    Letterbox,
    PhotometricJitter,
    RandomResizedCrop,
    ScaleJitter,
    crop,
    letterbox,
)

BOXES = [[10, 12, 50, 40], [60, 5, 95, 70], [0, 50, 30, 80], [70, 70, 100, 80]]


def _scene() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A 100-wide, 80-high image, channel k lit (1.0) exactly under box k."""
    image = torch.zeros(len(BOXES), 80, 100)
    for k, (x1, y1, x2, y2) in enumerate(BOXES):
        image[k, y1:y2, x1:x2] = 1.0
    return image, {"boxes": torch.tensor(BOXES, dtype=torch.float32),
                   "labels": torch.arange(len(BOXES))}


def _lit_extent(channel: torch.Tensor) -> torch.Tensor:
    """xyxy of the pixels above half (x2, y2 one past the last lit pixel)."""
    ys, xs = torch.nonzero(channel > 0.5, as_tuple=True)
    return torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32)


def _assert_under(image: torch.Tensor, target: dict, atol: float) -> None:
    assert target["boxes"].dtype == torch.float32
    assert len(target["boxes"]) == len(target["labels"])
    for box, label in zip(target["boxes"], target["labels"], strict=True):
        torch.testing.assert_close(_lit_extent(image[int(label)]), box, atol=atol, rtol=0)


def test_the_untransformed_scene_is_exact() -> None:
    _assert_under(*_scene(), atol=0)


def test_horizontal_flip_is_exact() -> None:
    image, target = HorizontalFlip(p=1.0)(*_scene(), torch.Generator().manual_seed(0))
    _assert_under(image, target, atol=0)
    assert target["boxes"][0].tolist() == [50, 12, 90, 40]  # x -> 100 - x
    same = HorizontalFlip(p=0.0)(*_scene(), torch.Generator())
    assert torch.equal(same[0], _scene()[0])


def test_crop_clips_and_drops_what_is_mostly_cut_away() -> None:
    image, target = crop(*_scene(), top=10, left=20, height=60, width=70, min_visible=0.3)
    assert image.shape == (4, 60, 70)
    # box 2 [0, 50, 30, 80] keeps x 20..30, y 50..70 = 10 x 20 of its 30 x 30: 22 % < 30 %
    assert target["labels"].tolist() == [0, 1]
    assert target["boxes"].tolist() == [[0, 2, 30, 30], [40, 0, 70, 60]]
    _assert_under(image, target, atol=0)
    # every dropped object's channel is (nearly) dark in the crop
    assert image[2].sum() < 0.3 * 30 * 30 and image[3].sum() == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_resized_crop_keeps_boxes_under_pixels(seed: int) -> None:
    t = RandomResizedCrop(size=64, scale=(0.3, 1.0), min_visible=0.3)
    image, target = t(*_scene(), torch.Generator().manual_seed(seed))
    assert image.shape == (4, 64, 64)
    _assert_under(image, target, atol=1.0)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("scale", [(0.5, 0.8), (1.2, 1.6)])
def test_scale_jitter_keeps_boxes_under_pixels(seed: int, scale: tuple[float, float]) -> None:
    image, target = ScaleJitter(scale)(*_scene(), torch.Generator().manual_seed(seed))
    assert scale[0] * 80 - 1 <= image.shape[1] <= scale[1] * 80 + 1
    _assert_under(image, target, atol=1.0)


def test_letterbox_keeps_boxes_under_pixels_and_unmaps() -> None:
    image, target, info = letterbox(*_scene(), size=64, fill=0.0)
    assert image.shape == (4, 64, 64)
    assert info.pad_x == 0 and info.pad_y > 0  # wider than high: bands above and below
    _assert_under(image, target, atol=1.0)
    torch.testing.assert_close(info.unmap(target["boxes"]), _scene()[1]["boxes"],
                               atol=1e-4, rtol=0)


def test_photometric_transforms_leave_boxes_and_range_alone() -> None:
    image, target = _scene()
    g = torch.Generator().manual_seed(1)
    out, t = Compose([PhotometricJitter(0.4, 0.4), GaussianNoise(0.05)])(image, target, g)
    assert torch.equal(t["boxes"], target["boxes"])
    assert out.min() >= 0 and out.max() <= 1 and not torch.equal(out, image)


def test_augmentations_are_seeded() -> None:
    t = Compose([HorizontalFlip(), RandomResizedCrop(48), PhotometricJitter(),
                 GaussianNoise(), Letterbox(56)])

    def run(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, target = t(*_scene(), torch.Generator().manual_seed(seed))
        return image, target["boxes"]

    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
