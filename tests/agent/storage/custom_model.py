"""A custom model factory, named ``tests.agent.storage.custom_model:build`` in a spec: the
registry fixtures' MLP under another name, so only the torch child can tell its tensors."""

from __future__ import annotations

from typing import Any

from torch import nn

from hpc_core.models import mlp


def build(**kwargs: Any) -> nn.Module:
    return mlp(**kwargs)
