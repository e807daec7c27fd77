"""Structured channel pruning: remove whole output channels and shrink their consumers.

The model is traced with ``torch.fx`` to find, for every convolution or linear layer, where
its output channels go. A layer is prunable when its output reaches only:
- channel-wise layers (BatchNorm, activations, pooling, dropout), which are shrunk with it,
- depthwise convolutions, shrunk with it too (their channels map one to one),
- a flatten whose per-channel block is known from shape propagation,
and ends in ordinary convolutions or linear layers, whose input dimension is shrunk. Anything
that mixes channels of several tensors (a residual add, a concat) or leaves the model ties the
layer to others, and it is left alone: in a ResNet the inner convolution of each block is
pruned while the channels the skip connections share are kept.

Which channels go: the smallest L1 norms of the filters, scaled by the following BatchNorm's
|gamma| / sqrt(var + eps) when there is one, so the ranking reflects what reaches the next
layer (Li et al., "Pruning Filters for Efficient ConvNets", 2017).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

_CHANNELWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid,
    nn.Tanh, nn.ELU, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.MaxPool1d,
    nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
)
_CHANNELWISE_FUNCTIONS = {
    F.relu, F.relu6, F.leaky_relu, F.silu, F.gelu, F.hardswish, F.sigmoid, F.dropout,
    F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d,
    torch.relu, torch.sigmoid, torch.tanh,
}
_CHANNELWISE_METHODS = {"relu", "sigmoid", "tanh", "contiguous"}
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class ChannelPruneError(ValueError):
    """The model cannot be channel-pruned (untraceable, or no independent layer)."""


@dataclass
class _Group:
    """One prunable layer and everything that must shrink with it."""

    producer: str
    batchnorms: list[str] = field(default_factory=list)
    depthwise: list[str] = field(default_factory=list)
    consumers: list[tuple[str, int]] = field(default_factory=list)
    """(module name, input features per channel: 1, or H*W after a flatten)."""


@dataclass
class ChannelPruneReport:
    layers: dict[str, tuple[int, int]]
    """Pruned layer -> (output channels before, after)."""
    skipped: list[str]
    """Conv/linear layers left whole (channels shared with a skip connection, or the output)."""


def _is_depthwise(m: nn.Module) -> bool:
    return isinstance(m, _CONVS) and m.groups > 1 and m.groups == m.in_channels == m.out_channels


def _is_dense(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or (isinstance(m, _CONVS) and m.groups == 1)


def _flatten_block(node: fx.Node) -> int | None:
    """Features per channel produced by a flatten from dim 1, or None if it is not that."""
    if node.op == "call_module":
        start = node.graph.owning_module.get_submodule(str(node.target)).start_dim
    else:
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    meta = node.args[0].meta.get("tensor_meta") if isinstance(node.args[0], fx.Node) else None
    if start != 1 or meta is None:
        return None
    block = 1
    for d in meta.shape[2:]:
        block *= int(d)
    return block


def _trace_group(gm: fx.GraphModule, producer: fx.Node) -> _Group | None:
    modules = dict(gm.named_modules())
    group = _Group(str(producer.target))
    frontier = [(user, 1) for user in producer.users]
    seen: set[fx.Node] = set()
    while frontier:
        node, block = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        passes = False
        if node.op == "call_module":
            m = modules[str(node.target)]
            if _is_depthwise(m) and block == 1:
                group.depthwise.append(str(node.target))
                passes = True
            elif _is_dense(m):
                group.consumers.append((str(node.target), block))
                continue
            elif isinstance(m, _BATCHNORMS) and block == 1:
                group.batchnorms.append(str(node.target))
                passes = True
            elif isinstance(m, nn.Flatten):
                flat = _flatten_block(node)
                if flat is None:
                    return None
                block, passes = block * flat, True
            else:
                passes = isinstance(m, _CHANNELWISE_MODULES)
        elif node.op == "call_function":
            if node.target is torch.flatten:
                flat = _flatten_block(node)
                if flat is None:
                    return None
                block, passes = block * flat, True
            else:
                passes = node.target in _CHANNELWISE_FUNCTIONS
        elif node.op == "call_method":
            passes = node.target in _CHANNELWISE_METHODS
        if not passes:
            return None
        frontier.extend((user, block) for user in node.users)
    return group if group.consumers else None


def _importance(model: nn.Module, group: _Group) -> torch.Tensor:
    layer = model.get_submodule(group.producer)
    w = layer.weight.detach()
    score = w.abs().flatten(1).sum(1)
    if group.batchnorms:
        bn = model.get_submodule(group.batchnorms[0])
        if bn.affine and bn.track_running_stats:
            score = score * (bn.weight.detach().abs() / torch.sqrt(bn.running_var + bn.eps))
    return score


def _keep_count(channels: int, amount: float, multiple_of: int) -> int:
    keep = max(1, round(channels * (1.0 - amount)))
    if multiple_of > 1:
        keep = min(channels, -(-keep // multiple_of) * multiple_of)
    return keep


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous())


def _shrink_outputs(m: nn.Module, keep: torch.Tensor) -> None:
    depthwise = _is_depthwise(m)
    m.weight = _param(m.weight[keep])
    if m.bias is not None:
        m.bias = _param(m.bias[keep])
    if isinstance(m, nn.Linear):
        m.out_features = len(keep)
    else:
        m.out_channels = len(keep)
        if depthwise:
            m.in_channels = m.groups = len(keep)


def _shrink_inputs(m: nn.Module, keep: torch.Tensor, block: int) -> None:
    cols = (keep[:, None] * block + torch.arange(block)).flatten()
    m.weight = _param(m.weight[:, cols])
    if isinstance(m, nn.Linear):
        m.in_features = len(cols)
    else:
        m.in_channels = len(cols)


def _shrink_batchnorm(bn: nn.Module, keep: torch.Tensor) -> None:
    if bn.affine:
        bn.weight = _param(bn.weight[keep])
        bn.bias = _param(bn.bias[keep])
    if bn.track_running_stats:
        bn.running_mean = bn.running_mean[keep].clone()
        bn.running_var = bn.running_var[keep].clone()
    bn.num_features = len(keep)


@torch.no_grad()
def prune_channels(
    model: nn.Module, amount: float, example_input: torch.Tensor, multiple_of: int = 1
) -> ChannelPruneReport:
    """Remove ``amount`` of the output channels of every independent conv/linear layer.

    ``model`` is changed in place. ``multiple_of`` rounds the kept channel counts up (8 suits
    tensor cores).
    """
    if not 0.0 < amount < 1.0:
        raise ValueError(f"channel pruning amount must be in (0, 1), got {amount}")
    was_training = model.training
    model.eval()
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:
        raise ChannelPruneError(
            f"channel pruning needs a model torch.fx can trace ({type(e).__name__}: {e}); "
            "use 2:4 or unstructured pruning for this model"
        ) from e
    ShapeProp(gm).propagate(example_input[:1].to(next(model.parameters()).device))
    modules = dict(gm.named_modules())
    groups, skipped = [], []
    for node in gm.graph.nodes:
        if node.op == "call_module" and _is_dense(modules[str(node.target)]):
            group = _trace_group(gm, node)
            (groups.append(group) if group else skipped.append(str(node.target)))
    if not groups:
        raise ChannelPruneError(
            "no conv/linear layer can be channel-pruned: every one feeds a skip connection, a "
            "concat, a GroupNorm or the output; use 2:4 or unstructured pruning"
        )
    # Rank on the original weights, then shrink: a layer is both a producer (dim 0) and a
    # consumer (dim 1) and the two cuts are independent.
    plans = []
    for g in groups:
        score = _importance(model, g)
        keep = _keep_count(len(score), amount, multiple_of)
        plans.append((g, score.topk(keep).indices.sort().values.cpu(), len(score)))
    report = ChannelPruneReport(layers={}, skipped=skipped)
    for g, keep, before in plans:
        _shrink_outputs(model.get_submodule(g.producer), keep)
        for name in g.batchnorms:
            _shrink_batchnorm(model.get_submodule(name), keep)
        for name in g.depthwise:
            _shrink_outputs(model.get_submodule(name), keep)
        for name, block in g.consumers:
            _shrink_inputs(model.get_submodule(name), keep, block)
        report.layers[g.producer] = (before, len(keep))
    model.train(was_training)
    return report
