"""What the devices' results give a learn: the versions their fine-tunes uploaded, which of
them a round combines, and their evaluations of a candidate.

Device results are input from outside: each is parsed here (a JobOutcome's ``uploaded``, an
evaluate job's ``evaluation``) and checked against what the round asked for (the release it
fine-tuned from, the candidate and baseline it scored); anything else is left out with the
reason, never passed on to ``hpc-train``. The device id is the one the topic proved (the
controller's execution), never a payload's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract import JobOutcome
from fleet.learn.store import ChosenUpdate, Dropped, Evaluation, Learn, RoundState
from fleet.rollout.run import RolloutRun
from registry.names import check_version


@dataclass(frozen=True)
class Upload:
    version: str
    device: str
    release: str
    """The release the fine-tune started from (the round's base, which the command named)."""
    finished_at: float


def uploads(run: RolloutRun, model: str, release: str) -> tuple[list[Upload], list[Dropped]]:
    """Every version a fine-tune of ``run`` uploaded (any attempt), and those left out."""
    out: list[Upload] = []
    bad: list[Dropped] = []
    for e in run.execs.values():
        if e.kind != "job" or e.status != "SUCCEEDED" or not e.result:
            continue
        try:
            up = JobOutcome.model_validate(e.result).uploaded
        except ValidationError:
            continue
        if up is None:
            continue  # its own gates rolled it back, or it did not upload
        try:
            check_version(up.version)
        except ValueError as err:
            bad.append(Dropped(device=e.device, reason=f"upload: {err}"))
            continue
        if up.name != model or up.parent != release:
            bad.append(Dropped(version=up.version, device=e.device, reason=(
                f"uploaded {up.name}@{up.version} with parent {up.parent}; the round asked "
                f"for a fine-tune of {model}@{release}")))
            continue
        out.append(Upload(up.version, e.device, release, e.finished_at or 0.0))
    return out, bad


def select(found: list[Upload], chain: list[str], spent: set[str],
           max_staleness: int) -> tuple[list[ChosenUpdate], list[Dropped]]:
    """The updates a round on ``chain[-1]`` combines: per device its freshest upload not yet
    spent, fine-tuned from one of the last ``max_staleness + 1`` releases of ``chain``
    (oldest first). Also what is dropped for good: a device's older uploads, and uploads
    from releases too far back (they only grow staler)."""
    newest = len(chain) - 1
    by_device: dict[str, list[tuple[int, Upload]]] = {}
    dropped: list[Dropped] = []
    for u in found:
        if u.version in spent:
            continue
        staleness = newest - chain.index(u.release) if u.release in chain else None
        if staleness is None or staleness > max_staleness:
            dropped.append(Dropped(version=u.version, device=u.device, reason=(
                f"fine-tuned from {u.release}, more than max_staleness {max_staleness} "
                f"releases before {chain[-1]}")))
            continue
        by_device.setdefault(u.device, []).append((staleness, u))
    chosen: list[ChosenUpdate] = []
    for device in sorted(by_device):
        ranked = sorted(by_device[device], key=lambda su: (su[0], -su[1].finished_at))
        staleness, best = ranked[0]
        chosen.append(ChosenUpdate(version=best.version, device=device, release=best.release,
                                   staleness=staleness))
        dropped += [Dropped(version=u.version, device=device,
                            reason=f"the same device's fresher upload {best.version} is used")
                    for _, u in ranked[1:]]
    return chosen, dropped


class _Scores(BaseModel):
    # The step's output carries more (runtime, finite, the step's memory): only these count.
    model_config = ConfigDict(extra="ignore")
    version: str | None = None
    accuracy: float = Field(ge=0, le=1)


class _DeviceEvaluation(BaseModel):
    """``result.evaluation`` of an evaluate job (``agent/jobs/steps/evaluate.py``)."""

    model_config = ConfigDict(extra="ignore")
    version: str
    accuracy: float = Field(ge=0, le=1)
    samples: int = Field(gt=0)
    baseline: _Scores


def evaluations(run: RolloutRun, candidate: str,
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
        got.append(Evaluation(device=device, samples=ev.samples, base_accuracy=ev.baseline.accuracy,
                              candidate_accuracy=ev.accuracy))
    return got, missing


class History:
    """What earlier rounds of a learn leave the current one (they no longer change): the
    chain of releases, the uploads spent, the fine-tune rollouts still to read uploads from."""

    def __init__(self, learn: Learn, rounds: list[RoundState], current: int) -> None:
        earlier = [r for r in rounds if r.round < current]
        self.chain = [learn.plan.base] + [r.release for r in earlier if r.release]
        self.spent: set[str] = set()
        for r in earlier:
            if r.aggregated:
                self.spent |= {u.version for u in r.updates}
            self.spent |= {d.version for d in r.dropped if d.version}
        self.finetunes = [(r.rollouts["finetune"], r.base) for r in earlier
                          if "finetune" in r.rollouts]
        self.checkpoints = {r.release: r.round for r in earlier if r.release}
        """release -> the round whose aggregate folder it was published from."""


def collect(learn: Learn, rs: RoundState, hist: History,
            run_of: Callable[[str], RolloutRun]) -> tuple[list[ChosenUpdate], list[Dropped]]:
    """What round ``rs`` would combine now, and what it would drop for good, from the
    uploads of its own fine-tune rollout and of the earlier rounds' (``run_of``: rollout id
    -> the rollout, from the controller or the store)."""
    found, bad = [], []
    for rid, release in [*hist.finetunes, (rs.rollouts["finetune"], rs.base)]:
        ups, wrong = uploads(run_of(rid), learn.plan.model, release)
        found += ups
        bad += [d for d in wrong if d.version not in hist.spent]
    chosen, dropped = select(found, hist.chain, hist.spent, learn.plan.max_staleness)
    return chosen, dropped + bad
