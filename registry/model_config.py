"""The model spec: which factory builds the module, with which arguments and sizes.

One type for both sides: a training config's ``model`` section and a registry manifest's
``model`` (where its sizes must be resolved, :class:`registry.manifest.Manifest`), so a device
rebuilds from a manifest exactly the module that was trained. Torch-free: building the module
is ``hpc_core.model_spec``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from registry.names import check_sha256
from registry.validation import StrictModel

TaskName = Literal["classification", "detection"]
"""What a model is trained to do; each has its implementation in ``hpc_core.tasks``."""

ECOSYSTEM_SOURCES = ("torchvision", "timm")
"""The libraries a ``SOURCE/NAME`` model name builds from (``hpc_core.vision.builders``)."""


class WeightsFile(StrictModel):
    """Pretrained weights from a local file, pinned by its sha256 (nothing is downloaded)."""

    path: str = Field(min_length=1)
    """A state dict: .safetensors (preferred: plain tensors, no code) or a torchvision/timm
    .pth checkpoint, read with torch.load(weights_only=True) only. Relative to the working
    directory. Convert a .pth once with `hpc-train convert-weights IN.pth OUT.safetensors`."""
    sha256: str
    """sha256 of the file (64 lower-case hex digits, `sha256sum FILE`); checked before it is
    read, a different file is refused. Recorded in each published version's
    training.pretrained, so a device knows which weights a release started from."""

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        return check_sha256(v)


class ModelConfig(StrictModel):
    task: TaskName = "classification"
    """What the model does: classification (one class per image) or detection (boxes, labels
    and scores). In a training config it follows the top-level `task` (leave it out there);
    a manifest carries it so a device knows what it holds without torch. Versions published
    before it existed are classifiers."""
    name: str = "small_cnn"
    """A registered model (mlp, small_cnn, resnet, mobilenet_v2, vit); an ecosystem model,
    'torchvision/NAME' (any torchvision classifier, or the detectors
    ssdlite320_mobilenet_v3_large, fcos_resnet18_fpn, retinanet_resnet18_fpn) or 'timm/NAME'
    (any timm model); or a Python factory 'package.module:function'."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the factory, e.g. {width: 32, norm: group} or {width_mult: 0.5}; for an
    ecosystem model, to the torchvision builder or timm.create_model (e.g. {drop_rate: 0.1})."""
    num_classes: int | None = Field(default=None, ge=2)
    """Output classes; filled in from the data set when null. A torchvision detector counts
    the background as torchvision does: label 0 is background, objects are 1..num_classes-1."""
    in_channels: int | None = Field(default=None, ge=1)
    """Input channels; filled in from the data set when null. An ecosystem model built for
    another count than 3 has its first convolution rebuilt for it (RGB pretrained weights are
    summed into one channel, or repeated, when loaded)."""
    image_size: int | None = Field(default=None, ge=1)
    """Input height = width in pixels; filled in from the data set when null. A detector
    resizes its input to it; a ViT is built for it."""
    weights: WeightsFile | None = None
    """Pretrained weights to start from (ecosystem models and the zoo alike): {path, sha256}.
    A head whose class count differs is left at its fresh initialisation and reported; a
    backbone that does not match is refused. Null: random initialisation."""

    @field_validator("name")
    @classmethod
    def _source(cls, v: str) -> str:
        if ":" in v:
            return v  # a custom factory 'package.module:function'
        source, sep, model = v.partition("/")
        if sep and (source not in ECOSYSTEM_SOURCES or not model or "/" in model):
            raise ValueError(
                f"{v!r}: a name with '/' is an ecosystem model, one of "
                f"{', '.join(s + '/NAME' for s in ECOSYSTEM_SOURCES)}"
            )
        return v
