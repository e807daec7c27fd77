"""The synthetic detection set's settings (``data.synthetic`` of a training config), torch-free
so that ``hpc_core.config`` reads them without loading the set's drawing code
(:mod:`hpc_core.tasks.detection.synthetic`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from registry.validation import StrictModel

CameraKind = Literal["invert", "noise", "blur", "rotate"]
"""The device cameras of :mod:`hpc_core.cameras` (kept torch-free here)."""
SyntheticClass = Literal["digit_0", "digit_1", "digit_2", "digit_3", "digit_4", "digit_5",
                         "digit_6", "digit_7", "digit_8", "digit_9", "square", "circle",
                         "triangle"]
"""The synthetic detection set's classes (:data:`hpc_core.tasks.detection.synthetic.
CLASS_NAMES`, kept torch-free here)."""


class SyntheticDetectionConfig(StrictModel):
    """The synthetic detection set (:mod:`hpc_core.tasks.detection.synthetic`): digits and
    shapes on textured backgrounds, 13 classes, drawn in memory, nothing downloaded."""

    images: int = Field(default=512, ge=2)
    """Images in the set (train and validation together, split by data.val_fraction)."""
    size: int = Field(default=320, ge=32, le=1024)
    """Side of each (square) image, in pixels."""
    seed: int = 0
    """The same seed draws the same set; image i depends only on (seed, i, size, cameras,
    classes, objects, object_size)."""
    cameras: list[CameraKind] = Field(default_factory=list)
    """Device cameras the whole set is seen through, in order (invert, noise, blur, rotate;
    rotate turns the boxes with the pixels)."""
    classes: list[SyntheticClass] | None = Field(default=None, min_length=1)
    """The classes drawn, labelled in this order, e.g. [square, circle, triangle]; null: all
    13 (digit_0 .. digit_9, square, circle, triangle)."""
    objects: tuple[int, int] = (1, 6)
    """Objects per image, [min, max] (fewer when no free place is found)."""
    object_size: tuple[float, float] = (0.08, 0.35)
    """Each object's side as a share of the image side, [min, max] (never under 8 px)."""

    @model_validator(mode="after")
    def _check(self) -> SyntheticDetectionConfig:
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise ValueError(f"classes {self.classes}: a class is listed twice")
        if not 1 <= self.objects[0] <= self.objects[1] <= 20:
            raise ValueError(f"objects {list(self.objects)}: need "
                             "1 <= min <= max <= 20")
        if not 0 < self.object_size[0] <= self.object_size[1] <= 1:
            raise ValueError(f"object_size {list(self.object_size)}: need "
                             "0 < min <= max <= 1 (shares of the image side)")
        return self
