"""What a spool keeps, and where a model's spool lives. Numpy-free: the daemon resolves
``data: spool`` with it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MB = 1 << 20
"""The spool's MB: 2^20 bytes."""
SPOOL_DATA = "spool"
"""The data name a fine-tune command gives to train on its model's spool. ``DATA_ROOT/spool``
holds the spools (one folder per model), so it is never a data set of its own."""
MARKER = "spool.json"
"""A spool folder's marker: the format and the config it was last opened with."""
FORMAT = "edgetrain.spool/1"


class SpoolConfig(BaseModel):
    """What a model's spool keeps and what it gives up first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quota_mb: float = Field(default=256.0, gt=0)
    """Most disk the spool's sample files may take, in MB (2^20 bytes; each file counted
    rounded up to the filesystem block). 90% of it holds kept samples; the last 10% holds
    samples evicted out of batch records until they are compacted away."""
    per_class_cap: int | None = Field(default=None, ge=1)
    """Most samples kept per label, pseudo-labels included (null: no cap); over it, the
    class's own samples are evicted by the hard_example rule."""
    max_age_s: float | None = Field(default=None, gt=0)
    """Samples older than this many seconds are dropped on the next record or open (null:
    kept until evicted)."""
    hard_example: Literal["margin", "entropy", "none"] = "margin"
    """Which samples stay when the spool is over its quota or a class over its cap: the ones
    the model was least sure of. margin: the softmax probability of the label (of the top
    class without one) minus the best other class's, so a confidently wrong prediction
    (negative margin) stays first; entropy: the softmax entropy, label-blind; none: oldest
    first. The most confident go first and, among equals, the oldest; a sample recorded
    without logits counts as the most confident."""
    pseudo_label_threshold: float | None = Field(default=None, gt=0, le=1)
    """An unlabelled sample whose top softmax probability reaches this is kept with the top
    class as its label, marked pseudo-labelled (null: off). Unlabelled samples that get no
    pseudo-label are dropped: a snapshot trains on labelled samples only, and nothing on the
    device labels them later, so they would only take quota from ones it can use."""
    min_free_disk_mb: float = Field(default=256.0, ge=0)
    """Recording stops (records are dropped and counted, never raised) while storing one
    would leave less than this much free space on the spool's filesystem, in MB."""


class SpoolMarker(BaseModel):
    """``spool.json``: a spool's format, and the config its last opener keeps it with (what a
    snapshot taker that has no config of its own, the fine-tune step, applies)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["edgetrain.spool/1"] = FORMAT
    config: SpoolConfig


def spool_dir(data_root: Path, model: str) -> Path:
    """Where ``model``'s spool lives: ``DATA_ROOT/spool/MODEL`` (``model`` is a checked model
    name, never a path)."""
    return Path(data_root) / SPOOL_DATA / model


def is_spool(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()
