"""The exportable core of a torchvision SSD detector and the settings of its post-processing.

A torchvision detector's forward pass takes a list of images, resizes and normalises them,
runs the network, decodes boxes from its anchors and runs NMS through torchvision's compiled
``nms`` operator, which does not load against this project's torch build (a pure-torch
stand-in answers it, ``hpc_core.vision.torchvision_ops``, and it has no ONNX symbolic). So
the export splits the model where quantization should stop: :class:`DetectorCore` is the
network alone, a batch of images at the model's ``image_size`` in, the raw head out
(``exporters.detection.outputs.HEAD_NAME``); :func:`tail_spec` reads what decoding and NMS
need (anchors at that size, box coder, thresholds), which ``exporters.detection.tail`` builds
as ONNX nodes after the core. Only SSD and SSDlite are exported today; other detectors are
refused by :func:`detector_unexportable` with what to do instead.
"""

from __future__ import annotations

import torch
from torch import nn

from exporters.detection.tail import TailSpec
from exporters.job import NO_EXPORT_FIX


def _is_ssd(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in ("anchor_generator", "box_coder", "head",
                                           "backbone", "transform", "topk_candidates"))


def detector_unexportable(model: nn.Module) -> str | None:
    """Why ``model`` (a detector) has no ONNX export here, or None."""
    if _is_ssd(model):
        return None
    return (f"a {type(model).__name__} detector has no ONNX export yet (SSD and SSDlite "
            f"do): {NO_EXPORT_FIX}")


class DetectorCore(nn.Module):
    """Normalisation, backbone and head of an SSD: ``[N, 3, S, S]`` in [0, 1] to
    ``[N, A, C + 4]`` (class logits, then box regressions, per anchor). The input must be
    at the model's own size: the detector's resize is then the identity and is left out."""

    def __init__(self, ssd: nn.Module) -> None:
        super().__init__()
        self.ssd = ssd
        t = ssd.transform
        self.register_buffer("mean", torch.tensor(t.image_mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(t.image_std).view(1, -1, 1, 1))
        self.train(ssd.training)  # a new module starts in train mode: keep the detector's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.ssd.backbone((x - self.mean) / self.std)
        head = self.ssd.head(list(features.values()))
        return torch.cat([head["cls_logits"], head["bbox_regression"]], dim=-1)


def image_size_of(ssd: nn.Module) -> int:
    """The square input size the detector resizes to (``model.image_size``)."""
    t = ssd.transform
    fixed = getattr(t, "fixed_size", None)
    return int(fixed[0]) if fixed else int(t.min_size[0])


@torch.no_grad()
def tail_spec(ssd: nn.Module) -> TailSpec:
    """The post-processing settings and anchors of ``ssd`` at its input size."""
    from torchvision.models.detection.image_list import ImageList

    size = image_size_of(ssd)
    was = ssd.training
    ssd.eval()
    x = torch.zeros(1, len(ssd.transform.image_mean), size, size)
    features = list(ssd.backbone(x).values())
    anchors = ssd.anchor_generator(ImageList(x, [(size, size)]), features)[0]
    head = ssd.head(features)
    ssd.train(was)
    return TailSpec(
        num_classes=int(head["cls_logits"].shape[-1]), image_size=size,
        anchors=anchors.tolist(), box_weights=tuple(float(w) for w in ssd.box_coder.weights),
        bbox_xform_clip=float(ssd.box_coder.bbox_xform_clip),
        score_thresh=float(ssd.score_thresh), nms_thresh=float(ssd.nms_thresh),
        topk_candidates=int(ssd.topk_candidates), detections_per_img=int(ssd.detections_per_img),
    )
