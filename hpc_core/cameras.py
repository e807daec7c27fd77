"""The device "cameras": how one device's sensor sees what upstream trained on.

The distortions model real sensor differences between the upstream data and one device, in
the order given; each works on the last two dimensions (an HxW image, CxHxW or NxCxHxW):

  invert   an IR / backlit camera: dark strokes on a bright field (x -> 1 - x)
  noise    sensor read noise: additive Gaussian, sigma 0.15, clipped to [0, 1]
  blur     a soft lens: 3x3 box blur (edges replicated)
  rotate   a camera mounted 90 degrees off (counter-clockwise)

One place for both kinds of data made from them: the classification digits of
``scripts/make_device_data.py`` and the detection set of
:mod:`hpc_core.tasks.detection.synthetic` (which also turns the boxes with ``rotate``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

KINDS = ("invert", "noise", "blur", "rotate")


def check_kinds(kinds: Sequence[str]) -> None:
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown camera {kind!r}: use {', '.join(KINDS)}")


def distort(x: torch.Tensor, kinds: Sequence[str], seed: int = 0,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (values in [0, 1]) as the cameras ``kinds`` see it, in order. The noise is drawn
    from ``generator``, or from one seeded with ``seed``."""
    check_kinds(kinds)
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    for kind in kinds:
        if kind == "invert":
            x = 1.0 - x
        elif kind == "noise":
            x = (x + 0.15 * torch.randn(x.shape, generator=g)).clamp(0, 1)
        elif kind == "blur":
            batched = x if x.dim() == 4 else x.reshape(-1, 1, *x.shape[-2:])
            out = F.avg_pool2d(F.pad(batched, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
            x = out.reshape(x.shape)
        else:  # rotate
            x = torch.rot90(x, 1, dims=(-2, -1))
    return x
