"""Pretrained weights from a local file pinned by sha256 (``model.weights``).

The file's sha256 is checked before a byte of it is parsed; a safetensors file is read as
plain tensors, a torchvision/timm ``.pth`` only with ``torch.load(weights_only=True)`` (a
pickle: safetensors is preferred, :func:`convert_to_safetensors`). Then the state dict is
fitted to the module the spec built:

* a tensor the module lacks is reported as unexpected (an auxiliary head, ...); one the
  file lacks refuses it, except BatchNorm's batch counter and the head;
* a classification head of another class count (the module's last parameters of a different
  shape, or a torchvision detector's ``head.classification_head``) is left at its fresh
  initialisation and reported;
* the first convolution of a module built for ``in_channels`` other than the file's takes
  the RGB kernel summed into one channel (grey input) or repeated and rescaled;
* anything else that does not fit - a backbone tensor of another shape, or no tensor in
  common - refuses the file: those are another model's weights.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from registry.model_config import WeightsFile

log = logging.getLogger("hpc_core.vision")

HEAD_TENSORS = 4
"""How many of the module's last state-dict entries may be a head left fresh when its shape
differs: weight and bias of one linear layer, or of a detector's classification conv pair."""
DETECTOR_CLASS_HEAD = "head.classification_head."
"""Where torchvision's detectors (SSD, RetinaNet, FCOS) keep their per-class convolutions:
before the box regression head in the state dict, so not among its last entries."""


class WeightsError(ValueError):
    """A weights file that cannot be used: missing, another hash, or another model's."""


@dataclass
class LoadReport:
    """What loading a weights file into a module did."""

    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    head_reset: list[str] = field(default_factory=list)
    adapted: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{self.loaded} tensors loaded"]
        for what, keys in (("head left fresh (class count differs)", self.head_reset),
                           ("input channels adapted", self.adapted),
                           ("missing from the file", self.missing),
                           ("unexpected in the file", self.unexpected)):
            if keys:
                parts.append(f"{what}: {', '.join(keys[:6])}" + (" ..." if len(keys) > 6 else ""))
        return "; ".join(parts)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_state_dict(ref: WeightsFile) -> dict[str, torch.Tensor]:
    """The file's tensors, after its sha256 matched ``ref.sha256``. The bytes are read once
    and parsed from memory: the file cannot change between the check and the parse."""
    path = Path(ref.path)
    if not path.is_file():
        raise WeightsError(f"model.weights.path: {path} is not a file")
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != ref.sha256:
        raise WeightsError(
            f"model.weights: {path} has sha256 {actual}, the config pins {ref.sha256}; "
            "refused (another file, or a corrupted copy)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load

        try:
            return load(data)
        except Exception as e:  # SafetensorError: a header that does not parse
            raise WeightsError(f"model.weights.path: {path} is no safetensors file: {e}") from None
    try:
        obj: Any = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and whatever a foreign file raises
        raise WeightsError(
            f"model.weights.path: {path} is not a weights-only torch checkpoint "
            f"({type(e).__name__}: {e}); convert it to safetensors where it was made") from None
    for key in ("state_dict", "model", "model_state"):  # common checkpoint wrappers
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"model.weights.path: {path} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def _adapt_input(name: str, have: torch.Tensor, want: torch.Size) -> torch.Tensor | None:
    """A first-conv kernel [out, 3, k, k] fitted to [out, c, k, k]."""
    if have.dim() != 4 or len(want) != 4 or have.shape[0] != want[0] or have.shape[2:] != want[2:]:
        return None
    c = want[1]
    if c == 1:
        return have.sum(dim=1, keepdim=True)
    reps = -(-c // have.shape[1])
    return have.repeat(1, reps, 1, 1)[:, :c] * (have.shape[1] / c)


def fit_state_dict(module: nn.Module, state: dict[str, torch.Tensor],
                   source: str) -> LoadReport:
    """Load ``state`` into ``module`` as the module docstring says; WeightsError when the
    backbone does not match."""
    own = module.state_dict()
    keys = list(own)
    head = set(keys[-HEAD_TENSORS:]) | {k for k in keys if k.startswith(DETECTOR_CLASS_HEAD)}
    first_conv = next((k for k, v in own.items() if k.endswith("weight") and v.dim() == 4), None)
    report = LoadReport()
    report.unexpected = sorted(set(state) - set(own))
    report.missing = [k for k in keys if k not in state]
    fitted: dict[str, torch.Tensor] = {}
    wrong = []
    for k in keys:
        if k not in state:
            continue
        v = state[k]
        if v.shape == own[k].shape:
            fitted[k] = v
        elif k == first_conv and (adapted := _adapt_input(k, v, own[k].shape)) is not None:
            fitted[k] = adapted
            report.adapted.append(k)
        elif k in head:
            report.head_reset.append(k)
        else:
            wrong.append(f"{k}: file {list(v.shape)}, model {list(own[k].shape)}")
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise WeightsError(f"model.weights: {source} is not this model's backbone: "
                           f"{'; '.join(wrong[:3])}{more}")
    if not fitted:
        raise WeightsError(f"model.weights: {source} shares no tensor with the model "
                           f"(it has e.g. {', '.join(list(state)[:3])}; the model "
                           f"{', '.join(keys[:3])})")
    # BatchNorm's batch counter is absent from older checkpoints; any other gap is another
    # model's weights (resnet18's file under resnet34 would leave its extra blocks random).
    backbone_missing = [k for k in report.missing
                        if k not in head and not k.endswith("num_batches_tracked")]
    if backbone_missing:
        raise WeightsError(f"model.weights: {source} lacks {len(backbone_missing)} of the "
                           f"model's {len(keys)} tensors (e.g. {backbone_missing[0]}): not "
                           "this model's backbone")
    module.load_state_dict(fitted, strict=False)
    report.loaded = len(fitted)
    return report


def load_pretrained(module: nn.Module, ref: WeightsFile) -> LoadReport:
    """Check ``ref``'s sha256, read it, fit it into ``module``; the report is logged."""
    report = fit_state_dict(module, read_state_dict(ref), ref.path)
    log.info("pretrained weights %s (sha256 %s...): %s", ref.path, ref.sha256[:12],
             report.summary())
    return report


def convert_to_safetensors(src: Path, dst: Path) -> tuple[int, str]:
    """Write a ``.pth`` state dict (read weights-only) as safetensors; (tensors, sha256)."""
    from safetensors.torch import save

    from registry.atomic import write_bytes_atomic

    ref = WeightsFile(path=str(src), sha256=file_sha256(src))
    state = {k: v.contiguous() for k, v in read_state_dict(ref).items()}
    data = save(state)
    write_bytes_atomic(dst, data, mode=0o644)
    return len(state), hashlib.sha256(data).hexdigest()
