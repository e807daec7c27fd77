"""Weight pruning: unstructured magnitude, 2:4 semi-structured, and structured channels.

Unstructured and 2:4 pruning zero weights in place and return the masks, so a recovery
fine-tune can keep them (``exporters.recovery``). Nothing is reparametrized: the model keeps
its plain ``weight`` parameters and state-dict keys, and the zeros are simply there — the
masks are permanent as soon as they are applied. Channel pruning (``exporters.channel_prune``)
instead removes channels and returns a smaller dense model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from exporters.job import PruneSpec

Masks = dict[str, torch.Tensor]
"""Parameter name -> bool tensor of its shape, True where the weight is kept."""


@dataclass
class LayerPruneStats:
    name: str
    shape: list[int]
    sparsity: float
    """Share of zero weights after pruning."""


@dataclass
class PruneResult:
    spec: PruneSpec
    masks: Masks
    layers: list[LayerPruneStats]
    extra: dict[str, Any] = field(default_factory=dict)
    """Method-specific details (channel counts before/after for channel pruning)."""

    @property
    def total_sparsity(self) -> float:
        total = sum(_numel(s.shape) for s in self.layers)
        zeros = sum(s.sparsity * _numel(s.shape) for s in self.layers)
        return zeros / total if total else 0.0


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def prunable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Convolutions and linear layers: where nearly all weights and compute are."""
    kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]


def magnitude_masks(model: nn.Module, amount: float, scope: str = "layer") -> Masks:
    """Keep the largest |w|: ``amount`` of the weights go, per layer or under one threshold."""
    layers = prunable_layers(model)
    weights = {f"{name}.weight": m.weight.detach() for name, m in layers}
    if scope == "global":
        flat = torch.cat([w.abs().flatten() for w in weights.values()])
        keep = _top_mask(flat, flat.numel() - round(amount * flat.numel()))
        masks, offset = {}, 0
        for name, w in weights.items():
            masks[name] = keep[offset : offset + w.numel()].view_as(w)
            offset += w.numel()
        return masks
    return {
        name: _top_mask(w.abs().flatten(), w.numel() - round(amount * w.numel())).view_as(w)
        for name, w in weights.items()
    }


def _top_mask(values: torch.Tensor, keep: int) -> torch.Tensor:
    # topk rather than a threshold: ties at the threshold would otherwise keep too many.
    mask = torch.zeros_like(values, dtype=torch.bool)
    if keep > 0:
        mask[values.topk(keep).indices] = True
    return mask


def semi_structured_eligible(module: nn.Module) -> bool:
    """2:4 runs along the input channels: they must come in whole groups of four, and
    grouped/depthwise convolutions have no sparse kernels."""
    if isinstance(module, nn.Linear):
        return module.in_features % 4 == 0
    return getattr(module, "groups", 1) == 1 and module.weight.shape[1] % 4 == 0


def semi_structured_masks(model: nn.Module) -> Masks:
    """In every group of four consecutive input-channel weights keep the two largest |w|.

    For a convolution weight ``[O, I, kh, kw]`` the groups run along ``I`` at each
    ``(o, kh, kw)``: the layout Ampere/Orin sparse tensor cores and TensorRT's
    SPARSE_WEIGHTS expect (NVIDIA's ASP prunes the same way).
    """
    masks: Masks = {}
    for name, m in prunable_layers(model):
        if not semi_structured_eligible(m):
            continue
        w = m.weight.detach().abs()
        last = w.movedim(1, -1)  # input channels last: [O, kh, kw, I]
        groups = last.reshape(-1, 4)
        mask = torch.zeros_like(groups, dtype=torch.bool)
        mask.scatter_(1, groups.topk(2, dim=1).indices, True)
        masks[f"{name}.weight"] = mask.reshape(last.shape).movedim(-1, 1).contiguous()
    if not masks:
        raise ValueError(
            "2:4 pruning found no eligible layer: it needs Conv/Linear layers whose input "
            "channels are a multiple of 4 (groups=1)"
        )
    return masks


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Masks) -> None:
    """Zero the masked weights in place."""
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        p = params[name]
        p.mul_(mask.to(device=p.device, dtype=p.dtype))


def layer_stats(model: nn.Module) -> list[LayerPruneStats]:
    return [
        LayerPruneStats(
            name=name,
            shape=list(m.weight.shape),
            sparsity=float((m.weight == 0).sum()) / m.weight.numel(),
        )
        for name, m in prunable_layers(model)
    ]


def prune_model(model: nn.Module, spec: PruneSpec, example_input: torch.Tensor) -> PruneResult:
    """Prune ``model`` in place (channels: its modules are replaced by smaller ones)."""
    if spec.method == "channels":
        from exporters.channel_prune import prune_channels

        report = prune_channels(model, spec.amount, example_input)
        return PruneResult(spec, {}, layer_stats(model), extra={"channels": report})
    if spec.method == "semi_structured":
        masks = semi_structured_masks(model)
    else:
        masks = magnitude_masks(model, spec.amount, spec.scope)
    apply_masks(model, masks)
    return PruneResult(spec, masks, layer_stats(model))
