"""A device's own part of a model: what personalized serving keeps of the device's model when
it takes the fleet's (FedPer's own head, FedBN's own normalization).

- ``head``: the last convolution or linear layer and everything registered after it, the
  scope ``trainable: head`` fine-tunes (the classifier a device's labels and camera shaped);
- ``norm``: every normalization layer's affine parameters and running statistics (BatchNorm,
  GroupNorm, LayerNorm, InstanceNorm): a camera's contrast and noise live there, which is why
  FedBN keeps them local under feature skew.

:func:`personalize` copies those tensors of the device's own model into the fleet's; the two
must be the same architecture (the same state-dict keys and shapes), which a device's
fine-tune of an earlier release always is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from agent.finetune.job import PersonalPart
from agent.finetune.model import last_layers

NORMS = (_BatchNorm, nn.GroupNorm, nn.LayerNorm, _InstanceNorm)


def _own_keys(prefix: str, module: nn.Module) -> list[str]:
    return [f"{prefix}{k}" for k in module.state_dict(keep_vars=True)
            if "." not in k]  # its own parameters and buffers, not its children's


def personal_keys(model: nn.Module, parts: Iterable[PersonalPart]) -> set[str]:
    """The state-dict keys of ``model`` that ``parts`` name."""
    parts = set(parts)
    keys: set[str] = set()
    if "head" in parts:
        first = last_layers(model, 1)[0]
        seen = False
        for name, m in model.named_modules():
            seen = seen or m is first
            if seen:
                keys.update(_own_keys(f"{name}." if name else "", m))
    if "norm" in parts:
        for name, m in model.named_modules():
            if isinstance(m, NORMS):
                keys.update(_own_keys(f"{name}." if name else "", m))
    return keys


def personalize(fleet: nn.Module, own: nn.Module, parts: Iterable[PersonalPart]) -> int:
    """Copy ``own``'s ``parts`` into ``fleet`` (in place); returns how many tensors."""
    keys = personal_keys(fleet, parts)
    mine, theirs = own.state_dict(), fleet.state_dict()
    for k in sorted(keys):
        if k not in mine or mine[k].shape != theirs[k].shape:
            raise ValueError(f"the device's own model has no tensor {k} of shape "
                             f"{tuple(theirs[k].shape)}: it is not the fleet model's "
                             "architecture")
    with torch.no_grad():
        fleet.load_state_dict({**theirs, **{k: mine[k] for k in keys}}, strict=True)
    return len(keys)
