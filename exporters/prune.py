"""Weight pruning: unstructured magnitude, 2:4 semi-structured, and structured channels.

Unstructured and 2:4 pruning zero weights in place and return the masks, so a recovery
fine-tune can keep them (``exporters.recovery``). Nothing is reparametrized: the model keeps
its plain ``weight`` parameters and state-dict keys, and the zeros are simply there — the
masks are permanent as soon as they are applied. Channel pruning (``exporters.channel_prune``)
instead removes channels and returns a smaller dense model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

PruneMethod = Literal["unstructured", "semi_structured", "channels"]
Masks = dict[str, torch.Tensor]
"""Parameter name -> bool tensor of its shape, True where the weight is kept."""

PRUNE_FORMS = "2:4 | unstructured:AMOUNT[:global|:layer] | channels:AMOUNT (AMOUNT in (0, 1))"


class PruneSpec(BaseModel):
    """What to prune. Written on the command line as ``2:4``, ``unstructured:0.5``,
    ``unstructured:0.5:global`` or ``channels:0.5``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: PruneMethod
    """unstructured: smallest |w| anywhere; semi_structured: 2 of every 4 weights along the
    input dimension (sparse tensor cores); channels: whole output channels removed."""
    amount: float = Field(gt=0.0, lt=1.0)
    """Share of weights (unstructured), or of output channels per layer (channels), removed.
    Always 0.5 for 2:4."""
    scope: Literal["layer", "global"] = "layer"
    """unstructured only: the same share in every layer, or one magnitude threshold for all."""

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        return parse_prune_text(data) if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check(self) -> PruneSpec:
        if self.method == "semi_structured" and self.amount != 0.5:
            raise ValueError("semi_structured pruning is 2:4, amount must be 0.5")
        if self.method != "unstructured" and self.scope != "layer":
            raise ValueError("scope=global applies to unstructured pruning only")
        return self

    @property
    def label(self) -> str:
        if self.method == "semi_structured":
            return "2:4"
        suffix = ":global" if self.scope == "global" else ""
        return f"{self.method}:{self.amount:g}{suffix}"


def parse_prune_text(text: str) -> dict[str, Any]:
    """``"unstructured:0.5:global"`` -> the fields of a :class:`PruneSpec`."""
    parts = text.strip().lower().split(":")
    if parts == ["2", "4"]:
        return {"method": "semi_structured", "amount": 0.5}
    if len(parts) in (2, 3) and parts[0] in ("unstructured", "channels"):
        try:
            amount = float(parts[1])
        except ValueError:
            raise ValueError(f"prune {text!r}: amount {parts[1]!r} is not a number; use "
                             f"{PRUNE_FORMS}") from None
        spec: dict[str, Any] = {"method": parts[0], "amount": amount}
        if len(parts) == 3:
            if parts[0] != "unstructured" or parts[2] not in ("global", "layer"):
                raise ValueError(f"prune {text!r}: use {PRUNE_FORMS}")
            spec["scope"] = parts[2]
        return spec
    raise ValueError(f"prune {text!r} is not understood: use {PRUNE_FORMS}")


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
