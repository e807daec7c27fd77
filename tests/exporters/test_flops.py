from __future__ import annotations

from torch import nn

from exporters.flops import count_flops


def test_counts_conv_and_linear_multiply_accumulates_twice() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),          # 8x8 out: 64 * 8 * (3*3*3) MACs
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8),  # depthwise, 4x4 out: 16 * 8 * 9
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),               # 128 * 10
    )
    flops = count_flops(model, (3, 8, 8))
    assert flops.per_layer == {"0": 2 * 64 * 8 * 27, "2": 2 * 16 * 8 * 9, "4": 2 * 128 * 10}
    assert flops.total == sum(flops.per_layer.values())


def test_leaves_the_model_mode_and_hooks_as_they_were() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    count_flops(model, (4,))
    assert model.training
    assert not model[0]._forward_hooks
