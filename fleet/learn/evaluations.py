"""The devices' evaluations of a round's candidate (``evaluate`` jobs), as the release's
device gates read them (``hpc-train publish --device-evals``, ``fleet.learn.gates``).

A device's result is input from outside: its ``evaluation`` is parsed here and counts only
when the job SUCCEEDED, the evaluation is well formed (gate metrics in [0, 1]: its task's
``metric``, top-1 accuracy or mAP, read as the accuracy the gates compare; samples > 0) and
it scored exactly the round's candidate beside the round's base; any other device is left
out with the reason (a ``Dropped``: ``fleetctl learn status`` lists them), and the
``--min-devices`` gate judges how many are left. The device id is the one the topic proved
(the controller's execution), never a payload's. ``write_device_evals`` writes what is left
for ``hpc-train publish --device-evals``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from fleet.learn.store import Dropped, Evaluation
from fleet.rollout.run import RolloutRun
from registry.atomic import write_json_atomic

EVALS_FILE = "device-evals.json"


# The task's gate metric (``metric``: top-1 of a classifier, mAP of a detector); an agent that
# predates it reports top-1 as ``accuracy`` only. nan (undefined) is out of [0, 1]: dropped.
_GATE = AliasChoices("metric", "accuracy")


class _Scores(BaseModel):
    # The step's output carries more (runtime, finite, the step's memory): only these count.
    model_config = ConfigDict(extra="ignore")
    version: str | None = None
    accuracy: float = Field(ge=0, le=1, validation_alias=_GATE)


class _DeviceEvaluation(BaseModel):
    """``result.evaluation`` of an evaluate job (``agent/jobs/steps/evaluate.py``)."""

    model_config = ConfigDict(extra="ignore")
    version: str
    accuracy: float = Field(ge=0, le=1, validation_alias=_GATE)
    samples: int = Field(gt=0)
    baseline: _Scores
    personalized: _Scores | None = None
    """The candidate personalized, where the round asked for it and the device has a model
    of its own."""


def read_evaluations(run: RolloutRun, candidate: str,
                     base: str) -> tuple[list[Evaluation], list[Dropped]]:
    """Each device's evaluation of ``candidate`` beside ``base`` (its last attempt), and the
    devices that gave none, with why."""
    got: list[Evaluation] = []
    missing: list[Dropped] = []
    for device, e in sorted(run.latest().items()):
        if e.status != "SUCCEEDED":
            why = f"{e.status}" + (f" {e.error_code}: {e.error_message}" if e.error_code else "")
            missing.append(Dropped(device=device, reason=why))
            continue
        try:
            ev = _DeviceEvaluation.model_validate((e.result or {}).get("evaluation"))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "evaluation"
            missing.append(Dropped(device=device, reason=f"result.evaluation.{where}: "
                                                         f"{first['msg']}"))
            continue
        if ev.version != candidate or ev.baseline.version != base:
            missing.append(Dropped(device=device, reason=(
                f"scored {ev.version} beside {ev.baseline.version}, not {candidate} beside "
                f"{base}")))
            continue
        got.append(Evaluation(
            device=device, samples=ev.samples, base_accuracy=ev.baseline.accuracy,
            candidate_accuracy=ev.accuracy,
            personalized_accuracy=ev.personalized.accuracy if ev.personalized else None))
    return got, missing


def write_device_evals(path: Path, evaluations: list[Evaluation]) -> None:
    """The device-evals file ``hpc-train publish --device-evals`` reads, written whole or not
    at all (from the round's record: a restarted controller writes the same file again)."""
    write_json_atomic(path, {"evaluations": [e.model_dump(exclude={"personalized_accuracy"})
                                             for e in evaluations]})
