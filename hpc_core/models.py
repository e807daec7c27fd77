"""Model registry: build a module from a name and keyword arguments.

Every factory takes ``num_classes``, ``in_channels`` and ``image_size`` plus its own keyword
arguments, so a model spec saved in a checkpoint (``ModelConfig``) is enough to rebuild the
module anywhere: upstream, on a device, or in an exporter.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

ModelFactory = Callable[..., nn.Module]
Norm = Literal["batch", "group", "none"]

_REGISTRY: dict[str, ModelFactory] = {}


def register(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Register a factory under ``name`` (decorator)."""

    def deco(fn: ModelFactory) -> ModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def resolve_factory(name: str) -> ModelFactory:
    """A registry name, or ``package.module:factory`` for a user model."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "/" in name and ":" not in name:  # torchvision/timm: imported on demand
        from hpc_core.vision.builders import resolve
        return resolve(name)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"model {name!r}: cannot import module {module_name!r}: {e}") from e
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ValueError(f"model {name!r}: {module_name} has no callable {attr!r}")
        return factory
    raise ValueError(f"unknown model {name!r}: use one of {available_models()}, "
                     "'torchvision/NAME', 'timm/NAME' or 'package.module:factory'")


def model_spec_errors(name: str, kwargs: dict[str, Any]) -> list[str]:
    """What ``hpc-train validate`` reports about a model spec before anything is built: an
    unknown name (with the known ones) or a kwarg the factory does not take, by field path."""
    try:
        factory = resolve_factory(name)
    except ValueError as e:
        return [f"  model.name: {e}"]
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    reserved = {"num_classes", "in_channels", "image_size"}
    takes = sorted(set(params) - reserved)
    return [
        f"  model.kwargs.{k}: {name} takes no argument {k!r} (it takes: {', '.join(takes)})"
        for k in kwargs
        if k not in params or k in reserved
    ]


def build_model(
    name: str, *, num_classes: int, in_channels: int, image_size: int, **kwargs: Any
) -> nn.Module:
    factory = resolve_factory(name)
    try:
        return factory(
            num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kwargs
        )
    except TypeError as e:
        raise ValueError(f"model {name!r}: bad arguments {sorted(kwargs)}: {e}") from e


def _norm2d(kind: Norm, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        # 8 groups where it divides, else one group per channel pair (GroupNorm needs a divisor).
        groups = math.gcd(8, channels)
        return nn.GroupNorm(groups, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be batch|group|none, got {kind!r}")


def _conv_block(cin: int, cout: int, norm: Norm, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=norm == "none"),
        _norm2d(norm, cout),
        nn.ReLU(inplace=True),
    )


@register("mlp")
def mlp(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    hidden: tuple[int, ...] | list[int] = (256, 128),
    dropout: float = 0.0,
) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


Pool = Literal["avg", "flatten"]


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head; fast on CPU, ~99% on digits. ``pool="avg"``
    (global average pooling) is size-agnostic; ``"flatten"`` max-pools once more and hands the
    head every position of the last feature map (``4 * width * (image_size // 4) ** 2``
    inputs): built for one size, its devices' fine-tunes average far better across unlike
    cameras (README, "Fleet learning")."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        width: int = 32,
        norm: Norm = "batch",
        dropout: float = 0.1,
        pool: Pool = "avg",
        image_size: int | None = None,
    ) -> None:
        super().__init__()
        if pool not in ("avg", "flatten"):
            raise ValueError(f"pool must be avg|flatten, got {pool!r}")
        if pool == "flatten" and (image_size is None or image_size < 4):
            raise ValueError(f"small_cnn pool flatten needs an image_size >= 4, got {image_size!r}")
        last = nn.AdaptiveAvgPool2d(1) if pool == "avg" else nn.MaxPool2d(2)
        features = 4 * width * (1 if pool == "avg" else (image_size or 0) // 4) ** 2
        self.features = nn.Sequential(
            _conv_block(in_channels, width, norm),
            _conv_block(width, 2 * width, norm),
            nn.MaxPool2d(2),
            _conv_block(2 * width, 4 * width, norm),
            last,
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(features, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@register("small_cnn")
def small_cnn(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    width: int = 32,
    norm: Norm = "batch",
    dropout: float = 0.1,
    pool: Pool = "avg",
) -> nn.Module:
    return SmallCNN(num_classes, in_channels, width=width, norm=norm, dropout=dropout,
                    pool=pool, image_size=image_size)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm2d(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = _norm2d(norm, cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm2d(norm, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small CIFAR-style ResNet: 3x3 stem, three stages of basic blocks."""

    def __init__(
        self, num_classes: int, in_channels: int, width: int, blocks: tuple[int, ...], norm: Norm
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            _norm2d(norm, width),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                stages.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1, norm))
                cin = cout
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


@register("resnet")
def resnet(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    width: int = 16,
    blocks: tuple[int, ...] | list[int] = (1, 1, 1),
    norm: Norm = "batch",
) -> nn.Module:
    del image_size
    return ResNet(num_classes, in_channels, width, tuple(blocks), norm)


def _make_divisible(v: float, divisor: int = 8) -> int:
    # As in torchvision's MobileNetV2: round channels to a multiple of 8, never below 90%.
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [
                nn.Conv2d(cin, hidden, 1, bias=False),
                nn.BatchNorm2d(hidden),
                nn.ReLU6(True),
            ]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(True),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 with a width multiplier, strides sized for small images (8-64 px)."""

    # (expansion, channels, repeats, stride) — torchvision's table, first strides relaxed.
    SETTINGS = (
        (1, 16, 1, 1),
        (6, 24, 2, 1),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(
        self, num_classes: int, in_channels: int, width_mult: float, dropout: float
    ) -> None:
        super().__init__()
        cin = _make_divisible(32 * width_mult)
        last = _make_divisible(1280 * max(1.0, width_mult))
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, cin, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cin),
            nn.ReLU6(True),
        ]
        for t, c, n, s in self.SETTINGS:
            cout = _make_divisible(c * width_mult)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers += [nn.Conv2d(cin, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6(True)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


@register("mobilenet_v2")
def mobilenet_v2(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    width_mult: float = 0.5,
    dropout: float = 0.2,
) -> nn.Module:
    del image_size
    if width_mult <= 0:
        raise ValueError(f"width_mult must be > 0, got {width_mult}")
    return MobileNetV2(num_classes, in_channels, width_mult, dropout)


class Attention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention``: PyTorch picks its
    flash or memory-efficient kernel where one applies, so the (tokens x tokens) score matrix
    is never kept for backward on the devices that have them.

    Both ONNX exporters (dynamo at opset 18, torchscript at 17) write the call out as
    Mul/MatMul/Softmax/MatMul, since opsets before 23 have no Attention op: the exported graph
    needs no fused kernel and no attention branch for export."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small vision transformer: strided-conv patches, learned positions, pre-LN blocks,
    mean-pooled tokens and a linear head (no CLS token: a mean exports as one ReduceMean)."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        image_size: int,
        patch: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        dropout: float,
    ) -> None:
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.Sequential(
            *(TransformerBlock(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(dim)
        # Registered last: agent.finetune's trainable=head and last_n:K count layers in
        # registration order, so the head must be the final Linear.
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def _default_patch(image_size: int) -> int:
    # About an 8x8 token grid (64 tokens: 32 px -> patch 4), but 2x2 patches at least so the
    # 8 px digits get 16 tokens; the largest divisor at or under that keeps every size legal.
    target = max(2, image_size // 8)
    return max(p for p in range(1, target + 1) if image_size % p == 0)


@register("vit")
def vit(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    patch: int | None = None,
    dim: int = 64,
    depth: int = 3,
    heads: int = 4,
    mlp_ratio: float = 2.0,
    dropout: float = 0.0,
) -> nn.Module:
    if patch is None:
        patch = _default_patch(image_size)
    if patch < 1 or image_size % patch:
        fits = [p for p in range(1, image_size + 1) if image_size % p == 0]
        raise ValueError(
            f"vit: model.kwargs.patch={patch} does not divide image_size={image_size}: use one "
            f"of {fits}, or leave patch unset ({_default_patch(image_size)} here)"
        )
    if heads < 1 or dim % heads:
        raise ValueError(
            f"vit: model.kwargs.dim={dim} is not a multiple of model.kwargs.heads={heads}: "
            "each head takes dim // heads channels"
        )
    if depth < 1:
        raise ValueError(f"vit: model.kwargs.depth must be >= 1, got {depth}")
    return ViT(num_classes, in_channels, image_size, patch, dim, depth, heads, mlp_ratio, dropout)
