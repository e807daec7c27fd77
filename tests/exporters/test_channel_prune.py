from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from exporters.channel_prune import ChannelPruneError, prune_channels
from exporters.flops import count_flops
from exporters.onnx_export import export_onnx
from exporters.ort_runner import OrtRunner
from hpc_core.models import build_model


def _silence_half_the_channels(model: nn.Module, producers: list[str]) -> None:
    """Make half the output channels of each producer exactly zero after its BN + ReLU, so
    removing them must leave the model's output unchanged."""
    modules = dict(model.named_modules())
    order = list(modules)
    with torch.no_grad():
        for name in producers:
            conv = modules[name]
            half = torch.arange(0, conv.out_channels, 2)
            conv.weight[half] = 0.0
            after = order[order.index(name) + 1 :]
            bn = next(modules[n] for n in after if isinstance(modules[n], nn.BatchNorm2d))
            bn.bias[half] = -1.0  # negative after BN, zero after ReLU
            bn.running_mean[half] = 0.0


@pytest.mark.parametrize(
    ("name", "producers"),
    [
        ("small_cnn", ["features.0.0", "features.1.0", "features.3.0"]),
        ("resnet", ["layers.0.conv1", "layers.1.conv1", "layers.2.conv1"]),
    ],
)
def test_removing_dead_channels_leaves_outputs_unchanged(name: str, producers: list[str]) -> None:
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=1, image_size=16).eval()
    _silence_half_the_channels(model, producers)
    x = torch.rand(8, 1, 16, 16)
    with torch.no_grad():
        before = model(x)
    report = prune_channels(model, 0.5, x)
    assert sorted(report.layers) == sorted(producers)
    with torch.no_grad():
        after = model(x)
    # The silenced channels rank lowest (L1 0) and go; BN and consumers were cut to match.
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_resnet_keeps_the_channels_its_skip_connections_share() -> None:
    model = build_model("resnet", num_classes=10, in_channels=1, image_size=16).eval()
    report = prune_channels(model, 0.5, torch.zeros(1, 1, 16, 16))
    assert {"stem.0", "layers.0.conv2", "layers.1.shortcut.0", "fc"} <= set(report.skipped)
    assert model.layers[1].conv1.out_channels == 16 and model.layers[1].bn1.num_features == 16
    assert model.layers[1].conv2.in_channels == 16 and model.layers[1].conv2.out_channels == 32


@pytest.mark.parametrize("which", ["cnn", "resnet"])
def test_half_the_channels_cut_flops_by_40_percent_and_runs_in_onnxruntime(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    trained: Any = request.getfixturevalue(which)
    model = trained.model()
    before = count_flops(model, trained.input_shape).total
    prune_channels(model, 0.5, torch.zeros(1, *trained.input_shape))
    after = count_flops(model, trained.input_shape).total
    assert after <= 0.6 * before, f"FLOPs {before} -> {after}"
    exported = export_onnx(model, tmp_path / "pruned.onnx", trained.input_shape)
    x, _ = trained.held_out()
    logits = OrtRunner(exported.path)(x[:16])
    with torch.no_grad():
        ref = model(torch.from_numpy(x[:16])).numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)


def test_flatten_of_a_spatial_map_shrinks_the_linear_by_whole_blocks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    ).eval()
    _silence_half_the_channels(model, ["0"])
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        before = model(x)
    prune_channels(model, 0.5, x)
    assert model[5].in_features == 4 * 4 * 4
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)


def test_models_without_independent_channels_are_refused() -> None:
    model = build_model("small_cnn", num_classes=10, in_channels=1, image_size=16, norm="group")
    with pytest.raises(ChannelPruneError, match="GroupNorm"):
        prune_channels(model, 0.5, torch.zeros(1, 1, 16, 16))


def test_untraceable_models_are_refused_with_the_alternatives() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) if x.sum() > 0 else -self.conv(x)

    with pytest.raises(ChannelPruneError, match="2:4 or unstructured"):
        prune_channels(DataDependent(), 0.5, torch.zeros(1, 1, 8, 8))
