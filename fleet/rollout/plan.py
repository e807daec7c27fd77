"""The rollout plan: what to run, on which devices, in which waves, and when to stop.

One pydantic model with ``extra="forbid"`` is the single source of truth for the plan; the
``fleetctl rollout create`` flags and ``--plan rollout.yaml`` both end up here, so a typo in
either is refused with the field's name (exit 2) before a single command leaves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from contract import check_id


class PlanError(ValueError):
    """A plan that does not validate; the message names each bad field and the fix."""


RATE_TRIGGERS = ("notified", "succeeded")
"""What ``rate_increase_after`` counts (AWS IoT Jobs' numberOfNotifiedThings and
numberOfSucceededThings)."""

GATE_METRIC = "gate"
"""``abort_metric``: whichever metric the device's gates compare, as its JobOutcome names it."""


def abort_metric_of(plan_metric: str, outcome_gate_metric: str | None) -> str:
    """The key a JobOutcome's figures are read under for the plan's ``abort_metric``:
    ``gate`` resolves to the outcome's ``gate_metric`` (eval/acc where an older agent names
    none: its models were classifiers)."""
    if plan_metric != GATE_METRIC:
        return plan_metric
    return outcome_gate_metric or "eval/acc"


class RolloutPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    """Rollout name; becomes part of every execution id, so it is topic-safe and short."""
    group: str | None = None
    """Target every device whose retained status lists this group (snapshot at creation)."""
    devices: list[str] | None = None
    """Or target these device ids explicitly."""
    job: Literal["finetune", "deploy", "evaluate"]
    """The device job each target runs (contract JOB_TYPES). ``evaluate`` scores a version on
    each device's held-out data and installs nothing (fleet learning's federated evaluation):
    its outcome's metrics_before / metrics_after are the baseline's and the candidate's."""
    args: dict[str, Any] = Field(default_factory=dict)
    """The job's args, sent as they are; the device validates them (REJECTED = never retried)."""
    waves: list[int | str] = Field(default_factory=lambda: ["100%"])
    """Cumulative wave targets: a device count (``1``) or a share of the targets (``"25%"``).
    ``[1, "5%", "25%", "100%"]`` = one canary, then up to 5%, 25% and every target."""
    bake_s: float = Field(default=0.0, ge=0)
    """Seconds to wait after a healthy wave before the next one starts."""
    max_per_minute: int | None = Field(default=None, gt=0)
    """Most commands sent per minute (None: as fast as the broker takes them): ``60`` or
    ``60/min`` (flag ``--rate`` or ``--max-per-minute``). With ``rate_increase`` it is the
    starting rate, which then grows (AWS IoT Jobs' exponential rollout)."""
    rate_increase: float | None = Field(default=None, gt=1, le=5)
    """Multiply the rate by this (1 < factor <= 5) each time ``rate_increase_after`` is met
    again, at most once a minute; needs ``max_per_minute``."""
    rate_increase_after: str | None = None
    """When the rate grows: ``notified:N`` (N more devices were sent the job since the last
    increase) or ``succeeded:N`` (N more devices succeeded)."""
    max_rate: int | None = Field(default=None, gt=0)
    """The rate never grows past this many per minute (None: no ceiling)."""
    approve_waves: bool = False
    """Before each wave after the first the rollout waits (``waiting_approval``) until an
    operator runs ``fleetctl rollout approve ID``."""
    follow_group: bool = False
    """With ``group``: a device that joins the group while the rollout runs gets it too, in
    the first wave not started yet (the last wave once every wave started); none after the
    rollout finished."""
    max_defers: int = Field(default=10, ge=0, le=1000)
    """How often a device may answer DEFERRED (busy fine-tuning or throttled: the command is
    sent again after the device's recheck time, no attempt and no failure counted); one more
    and the execution FAILED (DEFERRED_TOO_OFTEN, not retried)."""
    abort_failure_rate: float = Field(default=0.1, ge=0, le=1)
    """Abort when failed / completed exceeds this, once ``min_completed`` have completed. A
    device whose own gates rolled the new model back counts as failed."""
    min_completed: int = Field(default=5, ge=1)
    """Completed executions needed before the failure rate is judged."""
    abort_metric: str | None = GATE_METRIC
    """The held-out metric read from each JobOutcome (metrics_before / metrics_after):
    ``gate``, the one each device's gates compare (its JobOutcome's ``gate_metric``: eval/acc
    for a classifier, eval/map for a detector; eval/acc from an agent that does not name it),
    or a key such as ``eval/acc``."""
    max_metric_drop: float | None = Field(default=None, ge=0)
    """Abort when a wave's median (before - after) of ``abort_metric`` exceeds this."""
    timeout_s: float = Field(default=3600.0, gt=0)
    """Per execution, from send to terminal result; an offline device times out. The command
    also expires then, so a device that comes back later never starts a stale job."""
    retries: int = Field(default=0, ge=0, le=10)
    """Extra attempts after FAILED, TIMED_OUT or EXPIRED; REJECTED is never retried."""
    rollback_on_abort: bool = True
    """On abort, send ``rollback`` to every device that committed the new model."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check_id(v, "rollout name")
        if len(v) > 40:
            raise ValueError("at most 40 characters (it is part of execution ids)")
        return v

    @field_validator("max_per_minute", "max_rate", mode="before")
    @classmethod
    def _per_minute(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().endswith("/min"):  # "60/min" from --rate
            return v.strip()[:-4].strip()
        return v

    @field_validator("rate_increase_after")
    @classmethod
    def _increase_after(cls, v: str | None) -> str | None:
        if v is None:
            return v
        kind, _, n = v.partition(":")
        if kind not in RATE_TRIGGERS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"{v!r}: notified:N or succeeded:N with N >= 1, e.g. notified:50")
        return f"{kind}:{int(n)}"

    @field_validator("group")
    @classmethod
    def _group(cls, v: str | None) -> str | None:
        return None if v is None else check_id(v, "group")

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one device id, or use group")
        if len(set(v)) != len(v):
            raise ValueError("a device id is listed twice")
        return [check_id(d) for d in v]

    @field_validator("waves", mode="before")
    @classmethod
    def _split_waves(cls, v: Any) -> Any:
        if isinstance(v, str):  # "1,5%,25%,100%" from the command line
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("waves")
    @classmethod
    def _waves(cls, v: list[int | str]) -> list[int | str]:
        if not v:
            raise ValueError("give at least one wave, e.g. 1,5%,25%,100%")
        out: list[int | str] = []
        for w in v:
            if isinstance(w, str) and not w.endswith("%"):
                try:
                    w = int(w)
                except ValueError:
                    raise ValueError(
                        f"{w!r} is neither a device count nor a percentage like 25%"
                    ) from None
            if isinstance(w, int):
                if w < 1:
                    raise ValueError(f"a device count must be >= 1, got {w}")
            else:
                try:
                    pct = float(w[:-1])
                except ValueError:
                    raise ValueError(f"{w!r} is not a percentage like 25%") from None
                if not 0 < pct <= 100:
                    raise ValueError(f"{w!r} must be in (0%, 100%]")
            out.append(w)
        return out

    @model_validator(mode="after")
    def _targets(self) -> RolloutPlan:
        if (self.group is None) == (self.devices is None):
            raise ValueError("give exactly one of group or devices")
        if self.follow_group and self.group is None:
            raise ValueError("follow_group: needs group (a device list has nothing to join)")
        if (self.rate_increase is None) != (self.rate_increase_after is None):
            raise ValueError("rate_increase and rate_increase_after go together, e.g. "
                             "--rate-increase 2 --rate-increase-after notified:50")
        if (self.rate_increase is not None or self.max_rate is not None) \
                and self.max_per_minute is None:
            raise ValueError("rate_increase/max_rate: give the starting rate too "
                             "(--rate N/min)")
        if self.max_rate is not None and self.max_per_minute is not None \
                and self.max_rate < self.max_per_minute:
            raise ValueError("max_rate: below the starting rate max_per_minute")
        return self

    def rate_trigger(self) -> tuple[str, int] | None:
        """(``notified`` | ``succeeded``, N) of ``rate_increase_after``, or None."""
        if self.rate_increase_after is None:
            return None
        kind, n = self.rate_increase_after.split(":")
        return kind, int(n)

    def wave_sizes(self, n_targets: int) -> list[int]:
        """Cumulative device counts per wave for ``n_targets`` devices; a wave that would add
        no device is dropped, and the last wave always reaches every target only if the plan
        says so (a plan that stops at 50% rolls out to half the fleet)."""
        sizes: list[int] = []
        for w in self.waves:
            if isinstance(w, int):
                n = min(w, n_targets)
            else:
                n = min(n_targets, math.ceil(float(w[:-1]) / 100 * n_targets))
            if n > (sizes[-1] if sizes else 0):
                sizes.append(n)
        return sizes


def format_errors(e: ValidationError, source: str = "plan",
                  model: type[BaseModel] | None = None) -> str:
    """One line per error, naming the field; an unknown field lists ``model``'s known ones
    (rollout plans by default; ``fleet.learn.plan`` passes its own)."""
    known = (model or RolloutPlan).model_fields
    lines = [f"{source}: {e.error_count()} error(s)"]
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(plan)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; known: {', '.join(known)}"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def validate_plan(data: dict[str, Any], source: str = "plan") -> RolloutPlan:
    try:
        return RolloutPlan.model_validate(data)
    except ValidationError as e:
        raise PlanError(format_errors(e, source)) from None


def load_plan(path: Path, overrides: dict[str, Any] | None = None) -> RolloutPlan:
    """A YAML plan file, with command-line values laid over it."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise PlanError(f"{path}: cannot read the plan: {e}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: a plan is a mapping of fields, got {type(data).__name__}")
    data.update(overrides or {})
    return validate_plan(data, str(path))
