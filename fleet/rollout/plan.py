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
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
    """Most commands sent per minute (None: as fast as the broker takes them)."""
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
        return self

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
