"""The tensors each registered model holds, worked out without torch.

A device refuses a version whose tensors are not exactly those of the module its model spec
builds, before any chunk moves: installed, such a version would fail only when a fine-tune or
an export loads it. Building the module needs torch (~200 MB a process never gives back), so
for the registered models (``hpc_core.models``) the same table - state-dict key -> safetensors
dtype and shape - is computed here from the spec's numbers. Each function below mirrors one
factory, keyword for keyword, and refuses the specs that factory refuses;
``tests/hpc_core/test_model_layout.py`` holds every one equal to torch's ``state_dict()`` over
a grid of specs, and fails when a registered model has no function here.

A custom factory (``package.module:function``) is arbitrary code: only building it tells its
tensors, so it is checked by ``hpc_core.model_spec`` in a torch child process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from registry.errors import SpecMismatchError
from registry.manifest import LayoutRecord, Manifest
from registry.model_config import ECOSYSTEM_SOURCES, ModelConfig

Shape = tuple[int, ...]
Layout = dict[str, tuple[str, Shape]]
"""State-dict key -> (safetensors dtype name, shape)."""

F32, I64 = "F32", "I64"
"""Parameters and buffers are torch's default float32; BatchNorm counts batches in int64."""


def is_custom(name: str) -> bool:
    """A spec that names a Python factory to import rather than a registered model."""
    return ":" in name


def custom_refused(name: str) -> SpecMismatchError:
    return SpecMismatchError(
        f"model {name!r} names a Python factory to import; refused unless custom models "
        "are allowed (agentctl pull --allow-custom-model)"
    )


def _dim(value: Any, what: str) -> int:
    # torch refuses a float or a negative size when it allocates; a zero-width layer is no model.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a whole number >= 1, got {value!r}")
    return value


def _dropout(p: float) -> None:
    if p < 0 or p > 1:  # nn.Dropout's own check (a non-number raises TypeError here too)
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def _linear(out: Layout, prefix: str, fan_in: int, fan_out: int, bias: bool = True) -> None:
    out[f"{prefix}.weight"] = (F32, (fan_out, fan_in))
    if bias:
        out[f"{prefix}.bias"] = (F32, (fan_out,))


def _conv(out: Layout, prefix: str, cin: int, cout: int, k: int, *, groups: int = 1,
          bias: bool = True) -> None:
    out[f"{prefix}.weight"] = (F32, (cout, cin // groups, k, k))
    if bias:
        out[f"{prefix}.bias"] = (F32, (cout,))


def _batch_norm(out: Layout, prefix: str, channels: int) -> None:
    for name in ("weight", "bias", "running_mean", "running_var"):
        out[f"{prefix}.{name}"] = (F32, (channels,))
    out[f"{prefix}.num_batches_tracked"] = (I64, ())


def _norm2d(out: Layout, prefix: str, kind: str, channels: int) -> None:
    if kind == "batch":
        _batch_norm(out, prefix, channels)
    elif kind == "group":
        out[f"{prefix}.weight"] = (F32, (channels,))
        out[f"{prefix}.bias"] = (F32, (channels,))
    elif kind != "none":
        raise ValueError(f"norm must be batch|group|none, got {kind!r}")


def _conv_block(out: Layout, prefix: str, cin: int, cout: int, norm: str) -> None:
    _conv(out, f"{prefix}.0", cin, cout, 3, bias=norm == "none")
    _norm2d(out, f"{prefix}.1", norm, cout)


def mlp(*, num_classes: int, in_channels: int, image_size: int,
        hidden: Iterable[int] = (256, 128), dropout: float = 0.0) -> Layout:
    out: Layout = {}
    width, index = in_channels * image_size * image_size, 1  # 0 is the Flatten
    for h in hidden:
        h = _dim(h, "mlp: a hidden width")
        _linear(out, str(index), width, h)
        index += 2  # Linear, ReLU
        if dropout > 0:
            _dropout(dropout)
            index += 1
        width = h
    _linear(out, str(index), width, num_classes)
    return out


def small_cnn(*, num_classes: int, in_channels: int, image_size: int, width: int = 32,
              norm: str = "batch", dropout: float = 0.1, pool: str = "avg") -> Layout:
    w = _dim(width, "small_cnn: width")
    if pool == "avg":
        features = 4 * w
    elif pool == "flatten":
        if image_size < 4:
            raise ValueError(f"small_cnn pool flatten needs an image_size >= 4, got {image_size}")
        features = 4 * w * (image_size // 4) ** 2
    else:
        raise ValueError(f"pool must be avg|flatten, got {pool!r}")
    out: Layout = {}
    _conv_block(out, "features.0", in_channels, w, norm)
    _conv_block(out, "features.1", w, 2 * w, norm)
    _conv_block(out, "features.3", 2 * w, 4 * w, norm)  # 2 is the MaxPool
    _dropout(dropout)
    _linear(out, "head.2", features, num_classes)
    return out


def resnet(*, num_classes: int, in_channels: int, image_size: int, width: int = 16,
           blocks: Iterable[int] = (1, 1, 1), norm: str = "batch") -> Layout:
    del image_size
    w = _dim(width, "resnet: width")
    out: Layout = {}
    _conv(out, "stem.0", in_channels, w, 3, bias=False)
    _norm2d(out, "stem.1", norm, w)
    cin, index = w, 0
    for i, n in enumerate(tuple(blocks)):
        cout = w * 2**i
        for j in range(n):
            prefix, stride = f"layers.{index}", 2 if (i > 0 and j == 0) else 1
            _conv(out, f"{prefix}.conv1", cin, cout, 3, bias=False)
            _norm2d(out, f"{prefix}.bn1", norm, cout)
            _conv(out, f"{prefix}.conv2", cout, cout, 3, bias=False)
            _norm2d(out, f"{prefix}.bn2", norm, cout)
            if stride != 1 or cin != cout:
                _conv(out, f"{prefix}.shortcut.0", cin, cout, 1, bias=False)
                _norm2d(out, f"{prefix}.shortcut.1", norm, cout)
            cin, index = cout, index + 1
    _linear(out, "fc", cin, num_classes)
    return out


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


MOBILENET_V2_SETTINGS = (
    (1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
    (6, 320, 1, 1),
)
"""(expansion, channels, repeats, stride): ``hpc_core.models.MobileNetV2.SETTINGS``."""


def mobilenet_v2(*, num_classes: int, in_channels: int, image_size: int,
                 width_mult: float = 0.5, dropout: float = 0.2) -> Layout:
    del image_size
    if width_mult <= 0:
        raise ValueError(f"width_mult must be > 0, got {width_mult}")
    out: Layout = {}
    cin = _make_divisible(32 * width_mult)
    last = _make_divisible(1280 * max(1.0, width_mult))
    _conv(out, "features.0", in_channels, cin, 3, bias=False)
    _batch_norm(out, "features.1", cin)
    index = 3  # 2 is the ReLU6
    for t, c, n, _ in MOBILENET_V2_SETTINGS:
        cout = _make_divisible(c * width_mult)
        for _ in range(n):
            prefix, hidden, sub = f"features.{index}.conv", cin * t, 0
            if t != 1:
                _conv(out, f"{prefix}.0", cin, hidden, 1, bias=False)
                _batch_norm(out, f"{prefix}.1", hidden)
                sub = 3
            _conv(out, f"{prefix}.{sub}", hidden, hidden, 3, groups=hidden, bias=False)
            _batch_norm(out, f"{prefix}.{sub + 1}", hidden)
            _conv(out, f"{prefix}.{sub + 3}", hidden, cout, 1, bias=False)
            _batch_norm(out, f"{prefix}.{sub + 4}", cout)
            cin, index = cout, index + 1
    _conv(out, f"features.{index}", cin, last, 1, bias=False)
    _batch_norm(out, f"features.{index + 1}", last)
    _dropout(dropout)
    _linear(out, "classifier.1", last, num_classes)
    return out


def _default_patch(image_size: int) -> int:
    target = max(2, image_size // 8)
    return max(p for p in range(1, target + 1) if image_size % p == 0)


def vit(*, num_classes: int, in_channels: int, image_size: int, patch: int | None = None,
        dim: int = 64, depth: int = 3, heads: int = 4, mlp_ratio: float = 2.0,
        dropout: float = 0.0) -> Layout:
    # The factory's own refusals, in its words (hpc_core.models.vit).
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
    patch, dim = _dim(patch, "vit: patch"), _dim(dim, "vit: dim")
    hidden = _dim(int(dim * mlp_ratio), "vit: dim * mlp_ratio")
    _dropout(dropout)
    out: Layout = {}
    _conv(out, "patch_embed", in_channels, dim, patch)
    out["pos_embed"] = (F32, (1, (image_size // patch) ** 2, dim))
    for b in range(depth):
        prefix = f"blocks.{b}"
        for norm in ("norm1", "norm2"):
            out[f"{prefix}.{norm}.weight"] = (F32, (dim,))
            out[f"{prefix}.{norm}.bias"] = (F32, (dim,))
        _linear(out, f"{prefix}.attn.qkv", dim, 3 * dim)
        _linear(out, f"{prefix}.attn.proj", dim, dim)
        _linear(out, f"{prefix}.mlp.0", dim, hidden)
        _linear(out, f"{prefix}.mlp.3", hidden, dim)  # 1 GELU, 2 Dropout
    out["norm.weight"] = (F32, (dim,))
    out["norm.bias"] = (F32, (dim,))
    _linear(out, "head", dim, num_classes)
    return out


LAYOUTS: dict[str, Callable[..., Layout]] = {
    "mlp": mlp, "small_cnn": small_cnn, "resnet": resnet, "mobilenet_v2": mobilenet_v2,
    "vit": vit,
}


def expected_tensors(spec: ModelConfig) -> Layout:
    """The tensors the module ``spec`` names holds; :class:`SpecMismatchError` where it names
    no registered model or its factory would refuse its arguments."""
    if is_custom(spec.name):
        raise custom_refused(spec.name)
    layout = LAYOUTS.get(spec.name)
    if layout is None:
        raise SpecMismatchError(
            f"model spec {spec.name!r} does not build: unknown model {spec.name!r}: use one of "
            f"{sorted(LAYOUTS)} or 'package.module:factory'"
        )
    try:
        return layout(num_classes=spec.num_classes, in_channels=spec.in_channels,
                      image_size=spec.image_size, **spec.kwargs)
    except (TypeError, ValueError) as e:
        raise SpecMismatchError(f"model spec {spec.name!r} does not build: {e}") from None


def _differences(have: Layout, want: Layout, model: str) -> str | None:
    """The first five differences between two layouts, or None when they are equal."""
    problems = []
    for k in sorted(set(want) - set(have)):
        problems.append(f"missing tensor {k} ({want[k][0]}{list(want[k][1])})")
    for k in sorted(set(have) - set(want)):
        problems.append(f"unexpected tensor {k}")
    for k in sorted(set(want) & set(have)):
        if want[k] != have[k]:
            problems.append(
                f"tensor {k}: manifest has {have[k][0]}{list(have[k][1])}, "
                f"model {model} needs {want[k][0]}{list(want[k][1])}"
            )
    if not problems:
        return None
    more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    return "; ".join(problems[:5]) + more


def compare_tensors(manifest: Manifest, want: Layout) -> None:
    """Tensor names, dtypes and shapes must be exactly ``want``; the refusal names the first
    five differences."""
    have = {t.name: (t.dtype, tuple(t.shape)) for t in manifest.tensors}
    shown = _differences(have, want, manifest.model.name)
    if shown:
        raise SpecMismatchError(f"{manifest.ref} does not match its model spec: {shown}")


def is_ecosystem(name: str) -> bool:
    """A torchvision or timm model (``torchvision/NAME``, ``timm/NAME``): its layout is
    recorded in the manifest at publish, as no table here can follow those libraries."""
    return ":" not in name and name.partition("/")[0] in ECOSYSTEM_SOURCES and "/" in name


def compare_tensors_to_layout(record: LayoutRecord, have: Layout, source: str) -> None:
    """``have`` (a checkpoint's or a version's tensors) must be exactly the recorded layout."""
    want = {k: (dtype, tuple(shape)) for k, (dtype, shape) in record.tensors.items()}
    shown = _differences(have, want, record.built_from.name)
    if shown:
        raise SpecMismatchError(f"{source} does not match its model spec: {shown}")


def check_recorded_layout(manifest: Manifest) -> None:
    """The torch-free spec check of a torchvision/timm version: the manifest must carry the
    layout its publisher built from exactly this spec, and its tensors must be that layout."""
    record = manifest.layout
    if record is None:
        raise SpecMismatchError(
            f"{manifest.ref}: model {manifest.model.name!r} is a torchvision/timm model and the "
            "manifest records no layout (publish it with hpc-train publish, which builds the "
            "module and records its tensors)"
        )
    if record.built_from != manifest.model:
        raise SpecMismatchError(
            f"{manifest.ref}: the recorded layout was built from "
            f"{record.built_from.model_dump(exclude_none=True)}, not from the manifest's model "
            f"{manifest.model.model_dump(exclude_none=True)}"
        )
    have = {t.name: (t.dtype, tuple(t.shape)) for t in manifest.tensors}
    compare_tensors_to_layout(record, have, manifest.ref)


def check_layout(manifest: Manifest) -> None:
    """The torch-free spec check: a registered model's manifest tensors must be exactly those
    :func:`expected_tensors` gives; a torchvision/timm model's, its recorded layout."""
    if is_ecosystem(manifest.model.name):
        check_recorded_layout(manifest)
        return
    compare_tensors(manifest, expected_tensors(manifest.model))
