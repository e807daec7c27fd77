"""FLOPs of convolution and linear layers, measured with forward hooks on one input.

Only conv/linear layers are counted: they carry nearly all the arithmetic of the models
here, and they are what pruning shrinks. One multiply-accumulate counts as two FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FlopCount:
    total: int
    """FLOPs for one sample (2 x multiply-accumulates)."""
    per_layer: dict[str, int]


@torch.no_grad()
def count_flops(model: nn.Module, input_shape: tuple[int, ...]) -> FlopCount:
    """FLOPs of one forward pass of a single sample of shape ``input_shape`` (C, H, W)."""
    per_layer: dict[str, int] = {}
    handles = []

    def hook(name: str):  # type: ignore[no-untyped-def]
        def fn(m: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if isinstance(m, nn.Linear):
                macs = out.numel() * m.in_features
            else:
                kernel = m.weight[0].numel()  # in_channels / groups * prod(kernel_size)
                macs = out.numel() * kernel
            per_layer[name] = per_layer.get(name, 0) + 2 * macs

        return fn

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            handles.append(m.register_forward_hook(hook(name)))
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        model(torch.zeros(1, *input_shape, device=device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return FlopCount(total=sum(per_layer.values()), per_layer=per_layer)
