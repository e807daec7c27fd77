"""The model spec: which factory builds the module, with which arguments and sizes.

One type for both sides: a training config's ``model`` section and a registry manifest's
``model`` (where its sizes must be resolved, :class:`registry.manifest.Manifest`), so a device
rebuilds from a manifest exactly the module that was trained. Torch-free: building the module
is ``hpc_core.model_spec``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from registry.validation import StrictModel


class ModelConfig(StrictModel):
    name: str = "small_cnn"
    """A registered model (mlp, small_cnn, resnet, mobilenet_v2) or 'package.module:factory'."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the factory, e.g. {width: 32, norm: group} or {width_mult: 0.5}."""
    num_classes: int | None = Field(default=None, ge=2)
    """Output classes; filled in from the data set when null."""
    in_channels: int | None = Field(default=None, ge=1)
    """Input channels; filled in from the data set when null."""
    image_size: int | None = Field(default=None, ge=1)
    """Input height = width in pixels; filled in from the data set when null."""
