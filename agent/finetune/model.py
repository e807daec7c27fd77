"""The upstream model made ready to fine-tune: loaded from a slot or checkpoint, the trainable
scope applied, activation checkpointing on request."""

from __future__ import annotations

import functools
from pathlib import Path

from torch import nn
from torch.utils.checkpoint import checkpoint

from hpc_core import checkpoint as ckpt
from registry.model_config import ModelConfig


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def last_layers(model: nn.Module, k: int) -> list[nn.Module]:
    """The last ``k`` convolution or linear layers, in registration order: ``trainable:
    last:K`` (``head``: K = 1) trains the first of them and everything registered after it."""
    layers = _layers(model)
    if k > len(layers):
        raise ValueError(f"the model has only {len(layers)} conv/linear layers, not {k}")
    return layers[-k:]


def apply_trainable(model: nn.Module, scope: str) -> int:
    """Freeze all but ``scope``; return the number of trainable parameters."""
    if scope == "all":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        k = 1 if scope == "head" else int(scope.split(":")[1])
        try:
            first = last_layers(model, k)[0]
        except ValueError as e:
            raise ValueError(f"trainable={scope}: {e}") from None
        for p in model.parameters():
            p.requires_grad_(False)
        # Everything registered after the first trainable layer (incl. its norms) trains.
        seen = False
        for m in model.modules():
            seen = seen or m is first
            if seen:
                for p in m.parameters(recurse=False):
                    p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute the trainable children of every Sequential in backward; return how many."""
    count = 0
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        for block in seq.children():
            trainable = any(p.requires_grad for p in block.parameters())
            if trainable and not isinstance(block, nn.Sequential) and list(block.parameters()):
                # An instance attribute keeps state_dict keys unchanged (no wrapper module).
                block.forward = functools.partial(  # type: ignore[method-assign]
                    checkpoint, type(block).forward.__get__(block), use_reentrant=False
                )
                count += 1
    return count


def load_upstream(path: Path) -> tuple[nn.Module, ModelConfig]:
    """An installed A/B slot (signed manifest + safetensors) or an hpc_core checkpoint/run."""
    if (path / "manifest.json").is_file():
        from safetensors.torch import load_file

        from hpc_core.model_spec import build_module
        from registry.manifest import Manifest

        manifest = Manifest.from_bytes((path / "manifest.json").read_bytes(), source=str(path))
        model = build_module(manifest.model)  # the pull step verified signature and spec
        model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
        return model, manifest.model
    model, cfg = ckpt.load_model(ckpt.resolve_checkpoint(path))
    return model, cfg.model


def prepare_model(path: Path, trainable: str) -> tuple[nn.Module, ModelConfig]:
    model, spec = load_upstream(path)
    apply_trainable(model, trainable)
    return model, spec
