from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from exporters.job import PruneSpec
from exporters.onnx_weights import semi_structured_violations
from exporters.prune import (
    apply_masks,
    layer_stats,
    magnitude_masks,
    prune_model,
    semi_structured_masks,
)
from hpc_core.models import build_model


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return build_model("small_cnn", num_classes=10, in_channels=1, image_size=16).eval()


@pytest.mark.parametrize(
    ("text", "method", "amount", "scope", "label"),
    [
        ("2:4", "semi_structured", 0.5, "layer", "2:4"),
        ("unstructured:0.5", "unstructured", 0.5, "layer", "unstructured:0.5"),
        ("unstructured:0.7:global", "unstructured", 0.7, "global", "unstructured:0.7:global"),
        ("channels:0.25", "channels", 0.25, "layer", "channels:0.25"),
    ],
)
def test_spec_parses_command_line_forms(
    text: str, method: str, amount: float, scope: str, label: str
) -> None:
    spec = PruneSpec.model_validate(text)
    assert (spec.method, spec.amount, spec.scope, spec.label) == (method, amount, scope, label)


@pytest.mark.parametrize(
    "text", ["3:4", "unstructured", "unstructured:x", "unstructured:1.5", "channels:0.5:global",
             "magnitude:0.5", "unstructured:0.5:both"],
)
def test_spec_rejects_bad_forms_with_the_accepted_ones(text: str) -> None:
    with pytest.raises(ValidationError) as e:
        PruneSpec.model_validate(text)
    assert "2:4" in str(e.value) or "less than 1" in str(e.value)


def test_spec_rejects_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="extra"):
        PruneSpec.model_validate({"method": "unstructured", "amount": 0.5, "sparsity": 0.5})


def test_layerwise_magnitude_prunes_each_layer_to_the_amount_and_keeps_the_largest() -> None:
    model = _cnn()
    before = {n: m.weight.detach().clone() for n, m in model.named_modules()
              if isinstance(m, (nn.Conv2d, nn.Linear))}
    spec = PruneSpec.model_validate("unstructured:0.6")
    result = prune_model(model, spec, torch.zeros(1, 1, 16, 16))
    for stats in result.layers:
        n = before[stats.name].numel()
        assert stats.sparsity == pytest.approx(round(0.6 * n) / n)
        w = dict(model.named_modules())[stats.name].weight.detach()
        kept, dropped = before[stats.name][w != 0].abs(), before[stats.name][w == 0].abs()
        assert kept.min() >= dropped.max()


def test_global_magnitude_uses_one_threshold_across_layers() -> None:
    model = _cnn()
    masks = magnitude_masks(model, 0.5, "global")
    weights = {n: p.detach() for n, p in model.named_parameters() if n in masks}
    kept = torch.cat([weights[n][m].abs() for n, m in masks.items()])
    dropped = torch.cat([weights[n][~m].abs() for n, m in masks.items()])
    assert kept.min() >= dropped.max()
    total = sum(m.numel() for m in masks.values())
    assert sum(int((~m).sum()) for m in masks.values()) == round(0.5 * total)
    # One threshold means uneven per-layer sparsity, unlike the layer-wise mode.
    per_layer = {n: float((~m).float().mean()) for n, m in masks.items()}
    assert max(per_layer.values()) - min(per_layer.values()) > 0.05


def test_semi_structured_keeps_the_two_largest_of_every_four_input_channels() -> None:
    model = _cnn()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    masks = semi_structured_masks(model)
    apply_masks(model, masks)
    # The first conv has 1 input channel: no group of four, left dense.
    assert "features.0.0.weight" not in masks
    assert set(masks) == {"features.1.0.weight", "features.3.0.weight", "head.2.weight"}
    for name, mask in masks.items():
        w = dict(model.named_parameters())[name].detach().numpy()
        assert semi_structured_violations(w, axis=1) == 0
        assert float(mask.float().mean()) == 0.5
        # Along the input axis, each kept weight outranks the dropped ones of its group.
        groups = original[name].abs().movedim(1, -1).reshape(-1, 4)
        keep = mask.movedim(1, -1).reshape(-1, 4)
        assert bool((groups[keep].view(-1, 2).min(1).values
                     >= groups[~keep].view(-1, 2).max(1).values).all())


def test_masks_are_permanent_plain_parameters() -> None:
    model = _cnn()
    keys = set(model.state_dict())
    prune_model(model, PruneSpec.model_validate("2:4"), torch.zeros(1, 1, 16, 16))
    assert set(model.state_dict()) == keys  # no weight_orig / weight_mask re-parametrization
    assert not list(model._forward_pre_hooks.values())
    stats = {s.name: s.sparsity for s in layer_stats(model)}
    assert stats["features.1.0"] == 0.5 and stats["features.0.0"] == 0.0


def test_semi_structured_refuses_a_model_with_no_eligible_layer() -> None:
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(1, 1, 5, 5))
    model[2] = nn.Linear(27, 2)  # 27 inputs: not a multiple of 4
    with pytest.raises(ValueError, match="multiple of 4"):
        semi_structured_masks(model)
