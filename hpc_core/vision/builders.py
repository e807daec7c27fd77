"""Ecosystem models by name: ``torchvision/NAME`` and ``timm/NAME``.

The slash keeps these names apart from the project's own zoo (``resnet``, ``small_cnn``, ...)
and from a custom factory (``package.module:function``, a colon). Each is built with no
pretrained weights (and downloads refused, :mod:`hpc_core.vision.no_download`) and honours the
spec's sizes:

* ``torchvision/<classifier>``: any of ``torchvision.models.list_models(module=
  torchvision.models)`` (resnet18, mobilenet_v3_small, efficientnet_b0, vit_b_16, ...) with
  ``num_classes`` outputs. ``in_channels`` other than 3: the first convolution is rebuilt
  with that many input channels (pretrained RGB weights are summed or repeated into it when
  loaded, :mod:`hpc_core.vision.weights`). ``image_size``: ViTs are built for it (their
  position embedding is sized by it); the convolutional classifiers pool adaptively and take
  any size their downsampling survives (>= 32 px for most).
* ``torchvision/<detector>``: the detectors that fit a Jetson, :data:`DETECTORS`.
  ``num_classes`` counts the background as torchvision does: label 0 is background, objects
  are labelled 1..num_classes-1 (COCO's 80 classes are num_classes 91 with gaps). The
  detector resizes its input to ``image_size`` (its internal transform), normalises it with
  one mean/std per channel, and takes ``in_channels`` like the classifiers.
* ``timm/<model>``: ``timm.create_model(name, pretrained=False, num_classes=...,
  in_chans=in_channels)``, plus ``img_size=image_size`` for the models that take one
  (ViTs, ...). Any timm keyword can be given in ``model.kwargs``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from hpc_core.vision.no_download import downloads_refused
from hpc_core.vision.torchvision_ops import import_timm, import_torchvision

PREFIXES = ("torchvision", "timm")


def split_name(name: str) -> tuple[str, str] | None:
    """``("torchvision", "resnet18")`` for ``torchvision/resnet18``; None for any other name."""
    source, sep, model = name.partition("/")
    if not sep or source not in PREFIXES:
        return None
    return source, model


def _close(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    return f"; close names: {', '.join(close)}" if close else ""


def _first_conv(model: nn.Module) -> tuple[str, nn.Conv2d]:
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Conv2d):
            return path, mod
    raise ValueError("the model has no Conv2d to take the input channels")


def adapt_input_channels(model: nn.Module, in_channels: int) -> None:
    """Rebuild the first convolution (in module order: the stem) for ``in_channels``."""
    path, conv = _first_conv(model)
    if conv.in_channels == in_channels:
        return
    if conv.groups != 1:
        raise ValueError(f"the first convolution ({path}) is grouped; in_channels cannot change")
    new = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                    conv.padding, conv.dilation, 1, conv.bias is not None, conv.padding_mode,
                    device=conv.weight.device, dtype=conv.weight.dtype)
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, new)


# ---- torchvision classifiers -------------------------------------------------------------

def torchvision_classifiers() -> list[str]:
    tv = import_torchvision()
    return list(tv.models.list_models(module=tv.models))


def _classifier(name: str, *, num_classes: int, in_channels: int, image_size: int,
                **kwargs: Any) -> nn.Module:
    tv = import_torchvision()
    if name.startswith("vit_"):
        kwargs.setdefault("image_size", image_size)
    model = tv.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    adapt_input_channels(model, in_channels)
    return model


# ---- detectors ----------------------------------------------------------------------------

def _set_transform(model: nn.Module, image_size: int, in_channels: int,
                   mean: list[float], std: list[float]) -> None:
    t = model.transform  # GeneralizedRCNNTransform: resize to image_size, normalise
    t.min_size, t.max_size = (image_size,), image_size
    if getattr(t, "fixed_size", None) is not None:
        t.fixed_size = (image_size, image_size)
    if in_channels != 3:
        mean, std = [sum(mean) / 3] * in_channels, [sum(std) / 3] * in_channels
        adapt_input_channels(model, in_channels)
    t.image_mean, t.image_std = mean, std


SSDLITE_BN_MOMENTUM = 0.03
"""torchvision's BatchNorm momentum for SSDlite, set for its 600-epoch recipe."""


def ssdlite320_mobilenet_v3_large(*, num_classes: int, in_channels: int, image_size: int,
                                  bn_momentum: float = SSDLITE_BN_MOMENTUM,
                                  **kwargs: Any) -> nn.Module:
    """SSDlite on MobileNetV3-Large (3.4 M parameters at 91 classes); its 320 px anchors are
    relative, so it runs at any ``image_size``.

    ``bn_momentum``: how far each training batch moves BatchNorm's running statistics, which
    evaluation and export use. torchvision's 0.03 averages over ~33 steps, which lag far
    behind the weights of a short run from scratch (hundreds of steps: the model detects in
    train mode and finds nothing in eval mode); 0.1, PyTorch's default, follows them.
    Other keywords (``width_mult``, ``score_thresh``, ``topk_candidates``,
    ``detections_per_img``, ...) go to torchvision's builder."""
    _check_momentum(bn_momentum, SSDLITE_BN_MOMENTUM)
    tv = import_torchvision()
    model = tv.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=num_classes,
        norm_layer=partial(nn.BatchNorm2d, eps=0.001, momentum=bn_momentum), **kwargs)
    _set_transform(model, image_size, in_channels, [0.5] * 3, [0.5] * 3)
    return model


def _check_momentum(bn_momentum: float, default: float) -> None:
    if not 0 < bn_momentum <= 1:
        raise ValueError(f"model.kwargs.bn_momentum={bn_momentum}: give a share in (0, 1], "
                         f"e.g. 0.1 (this detector's default is {default})")


def _resnet18_fpn(tv: Any, bn_momentum: float) -> nn.Module:
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    # Plain BatchNorm (torchvision freezes it only under its own pretrained weights), so the
    # layout does not depend on whether model.weights is given.
    return tv.models.detection.backbone_utils.resnet_fpn_backbone(
        backbone_name="resnet18", weights=None,
        norm_layer=partial(nn.BatchNorm2d, momentum=bn_momentum), trainable_layers=5,
        returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))


IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
RESNET_BN_MOMENTUM = 0.1
"""PyTorch's BatchNorm default, which torchvision's ResNets keep."""


def fcos_resnet18_fpn(*, num_classes: int, in_channels: int, image_size: int,
                      bn_momentum: float = RESNET_BN_MOMENTUM, **kwargs: Any) -> nn.Module:
    """FCOS (anchor-free) on a ResNet-18 FPN with P6/P7, the layout torchvision's
    fcos_resnet50_fpn has on ResNet-50 (~14 M parameters). ``bn_momentum``: the backbone's
    BatchNorm (as SSDlite's); other keywords go to torchvision's FCOS."""
    _check_momentum(bn_momentum, RESNET_BN_MOMENTUM)
    tv = import_torchvision()
    model = tv.models.detection.FCOS(_resnet18_fpn(tv, bn_momentum), num_classes,
                                     min_size=image_size, max_size=image_size, **kwargs)
    _set_transform(model, image_size, in_channels, IMAGENET_MEAN, IMAGENET_STD)
    return model


def retinanet_resnet18_fpn(*, num_classes: int, in_channels: int, image_size: int,
                           bn_momentum: float = RESNET_BN_MOMENTUM,
                           **kwargs: Any) -> nn.Module:
    """RetinaNet on a ResNet-18 FPN with P6/P7 (as torchvision's retinanet_resnet50_fpn).
    ``bn_momentum`` and other keywords as for :func:`fcos_resnet18_fpn`."""
    _check_momentum(bn_momentum, RESNET_BN_MOMENTUM)
    tv = import_torchvision()
    model = tv.models.detection.RetinaNet(_resnet18_fpn(tv, bn_momentum), num_classes,
                                          min_size=image_size, max_size=image_size, **kwargs)
    _set_transform(model, image_size, in_channels, IMAGENET_MEAN, IMAGENET_STD)
    return model


DETECTORS: dict[str, Callable[..., nn.Module]] = {
    "ssdlite320_mobilenet_v3_large": ssdlite320_mobilenet_v3_large,
    "fcos_resnet18_fpn": fcos_resnet18_fpn,
    "retinanet_resnet18_fpn": retinanet_resnet18_fpn,
}
"""torchvision detectors small enough for a Jetson's memory and frame rate."""


def is_detector(name: str) -> bool:
    parts = split_name(name)
    return parts is not None and parts[0] == "torchvision" and parts[1] in DETECTORS


# ---- timm ---------------------------------------------------------------------------------

def _timm_model(name: str, *, num_classes: int, in_channels: int, image_size: int,
                **kwargs: Any) -> nn.Module:
    timm = import_timm()
    if kwargs.get("pretrained"):
        raise ValueError(f"model timm/{name}: pretrained=True would download; give "
                         "model.weights (a local file pinned by sha256) instead")
    kwargs.pop("pretrained", None)
    args = {"pretrained": False, "num_classes": num_classes, "in_chans": in_channels, **kwargs}
    if "img_size" not in kwargs:
        try:
            return timm.create_model(name, img_size=image_size, **args)
        except TypeError as e:
            if "img_size" not in str(e):
                raise
    return timm.create_model(name, **args)


# ---- by name ------------------------------------------------------------------------------

def resolve(name: str) -> Callable[..., nn.Module]:
    """The factory for an ecosystem name; ValueError naming ``model.name`` and close names
    when unknown."""
    parts = split_name(name)
    if parts is None:
        raise ValueError(f"model.name {name!r}: an ecosystem model is "
                         "'torchvision/NAME' or 'timm/NAME'")
    source, model = parts
    if source == "torchvision":
        if model in DETECTORS:
            factory = DETECTORS[model]
        else:
            known = torchvision_classifiers()
            if model not in known:
                raise ValueError(
                    f"model.name {name!r}: torchvision has no classifier {model!r} and "
                    f"edgetrain builds no detector of that name (detectors: "
                    f"{', '.join(DETECTORS)}){_close(model, known + list(DETECTORS))}")
            factory = partial(_classifier, model)
    else:
        timm = import_timm()
        if not timm.is_model(model):
            raise ValueError(f"model.name {name!r}: timm has no model {model!r}"
                             f"{_close(model, list(timm.list_models()))}")
        factory = partial(_timm_model, model)
    return _guarded(name, factory)


def _guarded(name: str, factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def build(*, num_classes: int, in_channels: int, image_size: int,
              **kwargs: Any) -> nn.Module:
        for key in ("weights", "weights_backbone"):
            if kwargs.get(key) is not None:
                raise ValueError(f"model.kwargs.{key}: torchvision would download it; give "
                                 "model.weights (a local file pinned by sha256) instead")
            kwargs.pop(key, None)
        with downloads_refused(name):
            return factory(num_classes=num_classes, in_channels=in_channels,
                           image_size=image_size, **kwargs)

    build.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY)
        for n in ("num_classes", "in_channels", "image_size")
    ] + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    return build
