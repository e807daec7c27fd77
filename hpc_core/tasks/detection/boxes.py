"""Box conventions and the checks every loader applies.

Inside the project a box is ``xyxy`` in absolute pixels (float32): ``x1, y1`` the top-left
corner, ``x2, y2`` the bottom-right one, so a box covering pixel columns ``0 .. 9`` is
``x1=0, x2=10``, as in COCO and torchvision. COCO files carry ``[x, y, w, h]`` in pixels and
YOLO files ``cx cy w h`` normalized by the image's width and height; both are converted here,
once, at the boundary.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

OUTSIDE_TOLERANCE_PX = 1.0
"""How far a box may reach past the image's edge and still be taken (then clipped): labelling
tools round, and a box drawn to the last pixel column often ends one pixel over."""

OnOutside = Literal["refuse", "clip"]
"""What a loader does with a box reaching past the image by more than the tolerance."""


class DetectionDataError(ValueError):
    """A data set that cannot be used as given; the message names each file, id or line,
    what is wrong and the fix, one problem per line."""

    def __init__(self, source: str, problems: list[str], shown: int = 20) -> None:
        self.problems = problems
        lines = [f"  {p}" for p in problems[:shown]]
        if len(problems) > shown:
            lines.append(f"  ... and {len(problems) - shown} more")
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(lines))


def coco_to_xyxy(xywh: np.ndarray) -> np.ndarray:
    """COCO's ``[x, y, w, h]`` (pixels) to ``xyxy`` (pixels), float32, shape (N, 4)."""
    b = np.asarray(xywh, dtype=np.float64).reshape(-1, 4)
    return np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], axis=1).astype(np.float32)


def xyxy_to_coco(xyxy: np.ndarray) -> np.ndarray:
    """``xyxy`` to COCO's ``[x, y, w, h]``, float64 (written to JSON as is)."""
    b = np.asarray(xyxy, dtype=np.float64).reshape(-1, 4)
    return np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], axis=1)


def yolo_to_xyxy(cxcywh: np.ndarray, width: int, height: int) -> np.ndarray:
    """YOLO's normalized ``cx cy w h`` to ``xyxy`` pixels of a ``width`` x ``height`` image."""
    b = np.asarray(cxcywh, dtype=np.float64).reshape(-1, 4)
    scale = np.array([width, height, width, height], dtype=np.float64)
    half = b[:, 2:] / 2
    return (np.concatenate([b[:, :2] - half, b[:, :2] + half], axis=1) * scale).astype(
        np.float32
    )


def xyxy_to_yolo(xyxy: np.ndarray, width: int, height: int) -> np.ndarray:
    """``xyxy`` pixels to YOLO's normalized ``cx cy w h`` (float64)."""
    b = np.asarray(xyxy, dtype=np.float64).reshape(-1, 4)
    wh = b[:, 2:] - b[:, :2]
    c = b[:, :2] + wh / 2
    return np.concatenate([c, wh], axis=1) / np.array([width, height, width, height])


def check_box(
    box: np.ndarray, width: int, height: int, on_outside: OnOutside
) -> tuple[np.ndarray | None, str | None]:
    """One ``xyxy`` box against a ``width`` x ``height`` image: ``(box, None)`` when usable
    (clipped to the image when it reached past the edge by at most the tolerance, or by
    more with ``on_outside="clip"``), else ``(None, what is wrong and the fix)``."""
    x1, y1, x2, y2 = (float(v) for v in box)
    if not all(np.isfinite([x1, y1, x2, y2])):
        return None, "coordinates are not finite numbers: fix the box"
    if x2 - x1 <= 0 or y2 - y1 <= 0:
        return None, (f"non-positive width or height ({x2 - x1:g} x {y2 - y1:g} px): "
                      "fix the box or remove the annotation")
    over = max(-x1, -y1, x2 - width, y2 - height)
    if over > OUTSIDE_TOLERANCE_PX and on_outside == "refuse":
        return None, (f"box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] (xyxy) reaches {over:g} px outside "
                      f"the {width}x{height} image (tolerance {OUTSIDE_TOLERANCE_PX:g} px): "
                      "refused; fix the box, or load with on_outside='clip' to clip it")
    clipped = np.array([max(x1, 0.0), max(y1, 0.0), min(x2, width), min(y2, height)],
                       dtype=np.float32)
    if clipped[2] - clipped[0] <= 0 or clipped[3] - clipped[1] <= 0:
        return None, (f"box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] lies wholly outside the "
                      f"{width}x{height} image: fix the box or remove the annotation")
    return clipped, None


def box_area(xyxy: np.ndarray) -> np.ndarray:
    """Areas (pixels²) of ``xyxy`` boxes, shape (N,)."""
    b = np.asarray(xyxy, dtype=np.float64).reshape(-1, 4)
    return (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
