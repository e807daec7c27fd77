"""``hpc-train publish --device-evals FILE``: each device's accuracy of the base release and of
the aggregate on its own held-out data, as the operator collected them. "Accuracy" is the
gate metric of the model's task, as the device's evaluate job scored it through the task
(top-1 of a classifier, mAP@0.5:0.95 of a detector): a fraction in [0, 1] either way, so one
file and one set of gates serve every task (``nan``, an undefined metric, is refused).

The file is input from outside (written by hand or by a fleet script): unknown keys, strings
for numbers, accuracies outside [0, 1], non-positive sample counts and a device listed twice
are refused with the field's path. The gates that read it are ``hpc_core.aggregation.gates``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from contract.ids import check_id
from registry.errors import MalformedJsonError, UsageError
from registry.jsonsafe import loads_strict
from registry.validation import format_errors

MAX_EVALS_BYTES = 16 << 20
"""A file larger than this is refused unread (100k devices fit in ~10 MB)."""

GainMean = Literal["devices", "samples"]
"""How the mean gain weighs devices: each once, or by its sample count."""


class DeviceEvaluation(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    device: str
    """The device id, as the fleet names it."""
    samples: int = Field(gt=0)
    """Held-out samples the device scored both models on."""
    base_accuracy: float = Field(ge=0.0, le=1.0)
    """The base release's gate metric on them (top-1 accuracy of a classifier, mAP of a
    detector), a fraction in [0, 1]."""
    candidate_accuracy: float = Field(ge=0.0, le=1.0)
    """The aggregate's gate metric on the same samples, a fraction in [0, 1]."""

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_id(v)

    @property
    def gain_pts(self) -> float:
        """Candidate minus base, in percentage points."""
        return 100.0 * (self.candidate_accuracy - self.base_accuracy)


class DeviceEvals(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    evaluations: list[DeviceEvaluation]

    @field_validator("evaluations")
    @classmethod
    def _unique(cls, v: list[DeviceEvaluation]) -> list[DeviceEvaluation]:
        seen: set[str] = set()
        for e in v:
            if e.device in seen:
                raise ValueError(f"device {e.device} is listed twice: keep one evaluation each")
            seen.add(e.device)
        return v

    def mean_gain_pts(self, by: GainMean) -> float:
        """The mean gain in points; needs at least one evaluation."""
        evals = self.evaluations
        if by == "samples":
            return sum(e.gain_pts * e.samples for e in evals) / sum(e.samples for e in evals)
        return sum(e.gain_pts for e in evals) / len(evals)


def load_device_evals(path: Path) -> DeviceEvals:
    """Parse and validate the file; UsageError (exit 2) naming the field and the fix."""
    try:
        doc = loads_strict(Path(path).read_bytes(), str(path), max_bytes=MAX_EVALS_BYTES)
        return DeviceEvals.model_validate(doc)
    except OSError as e:
        raise UsageError(f"--device-evals {path}: {e.strerror or e}") from None
    except MalformedJsonError as e:
        raise UsageError(f"--device-evals {e}") from None
    except ValidationError as e:
        # format_errors finds a model's known keys through its fields, not through a list's
        # items: name an evaluation's keys here.
        known = f"(known keys: {', '.join(DeviceEvaluation.model_fields)})"
        lines = "\n".join(line.replace("(known keys: )", known)
                          for line in format_errors(e, DeviceEvals))
        raise UsageError(
            f"--device-evals {path} does not validate (want {{\"evaluations\": [{{\"device\": "
            f"ID, \"samples\": N > 0, \"base_accuracy\": 0..1, \"candidate_accuracy\": 0..1}}, "
            f"...]}}):\n{lines}") from None
