"""The device cameras: one implementation for the classification digits and the detection set,
each distortion doing what its name says on any leading shape."""

from __future__ import annotations

import pytest
import torch

from hpc_core.cameras import KINDS, distort


def test_each_camera_on_a_batch_equals_it_on_each_image() -> None:
    x = torch.rand(3, 2, 9, 7, generator=torch.Generator().manual_seed(1))
    for kind in KINDS:
        if kind == "noise":  # one draw for the batch: compare against the same draw
            continue
        whole = distort(x, [kind])
        for i in range(3):
            assert torch.allclose(whole[i], distort(x[i], [kind])), kind


def test_what_each_camera_does() -> None:
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, 0, 3] = 1.0  # top right
    assert torch.equal(distort(x, ["invert"]), 1 - x)
    assert distort(x, ["rotate"])[0, 0, 0, 0] == 1.0  # counter-clockwise: top right -> top left
    blurred = distort(x, ["blur"])
    assert blurred.sum() > 0 and blurred.max() < 1.0 and blurred[0, 0, 3, 0] == 0.0
    noisy = distort(torch.full((1, 1, 64, 64), 0.5), ["noise"], seed=3)
    assert 0.10 < float(noisy.std()) < 0.20 and noisy.min() >= 0 and noisy.max() <= 1
    assert torch.equal(noisy, distort(torch.full((1, 1, 64, 64), 0.5), ["noise"], seed=3))
    with pytest.raises(ValueError, match="unknown camera 'sepia'"):
        distort(x, ["sepia"])
