from __future__ import annotations

import pytest
import torch
from torch import nn

from hpc_core.models import available_models, build_model


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("mlp", {"hidden": [32, 16]}),
        ("small_cnn", {"width": 8}),
        ("small_cnn", {"width": 8, "norm": "group"}),
        ("resnet", {"width": 8, "norm": "batch"}),
        ("resnet", {"width": 8, "norm": "group", "blocks": [2, 1, 1]}),
        ("mobilenet_v2", {"width_mult": 0.25}),
    ],
)
def test_registry_models_forward_and_backward(name: str, kwargs: dict) -> None:
    model = build_model(name, num_classes=10, in_channels=3, image_size=16, **kwargs)
    out = model(torch.randn(4, 3, 16, 16))
    assert out.shape == (4, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_group_norm_really_replaces_batch_norm() -> None:
    m = build_model("resnet", num_classes=10, in_channels=1, image_size=8, norm="group")
    kinds = {type(x) for x in m.modules()}
    assert nn.GroupNorm in kinds and nn.BatchNorm2d not in kinds


def test_width_multiplier_scales_mobilenet() -> None:
    def count(w: float) -> int:
        m = build_model("mobilenet_v2", num_classes=10, in_channels=1, image_size=8, width_mult=w)
        return sum(p.numel() for p in m.parameters())

    assert count(0.25) < count(0.5) < count(1.0)


def test_user_factory_by_import_path() -> None:
    m = build_model("tests.hpc_core.user_model:tiny", num_classes=3, in_channels=1, image_size=4)
    assert m(torch.zeros(2, 1, 4, 4)).shape == (2, 3)


def test_unknown_model_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'vgg'.*small_cnn"):
        build_model("vgg", num_classes=3, in_channels=1, image_size=4)
    with pytest.raises(ValueError, match="cannot import module"):
        build_model("no_such_pkg.mod:f", num_classes=3, in_channels=1, image_size=4)
    with pytest.raises(ValueError, match="bad arguments"):
        build_model("small_cnn", num_classes=3, in_channels=1, image_size=4, depth=3)
    assert set(available_models()) >= {"mlp", "small_cnn", "resnet", "mobilenet_v2"}
