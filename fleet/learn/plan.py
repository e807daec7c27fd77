"""The learn plan: which devices learn, from which release, for how many rounds, how updates
are combined and which gates a candidate must pass before it becomes the next release.

One pydantic model with ``extra="forbid"`` (``LearnPlan``), the single source of the
``fleetctl learn start`` flags and of ``--plan learn.yaml``, like ``RolloutPlan`` is for
rollouts. Everything that would only fail in round 3 is checked here, before anything is sent:
the three rollout plans a round creates are built once from the plan at validation time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from contract import check_id
from fleet.rollout.plan import PlanError, RolloutPlan, format_errors
from registry.names import check_model_name, check_version

Phase = Literal["finetune", "evaluate", "deploy"]
"""The rollouts a round makes (``{name}-r{round}-ft|ev|dp``)."""
ROLLOUT_SUFFIX: dict[str, str] = {"finetune": "ft", "evaluate": "ev", "deploy": "dp"}
MAX_NAME = 30
"""A learn's name is part of its rollouts' names (40 characters at most): ``-r999-ft`` fits."""
RESERVED_FINETUNE_ARGS = ("model", "version", "data", "upload")
"""What the learn sets in every fine-tune command itself (``steps.upload`` too)."""


class LearnPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    """The learn's name: its rollouts are ``NAME-rK-ft`` (fine-tune), ``-ev`` (evaluate) and
    ``-dp`` (deploy), and its versions ``PREFIX-rK-candidate`` and ``PREFIX-rK``."""
    group: str | None = None
    """Every device of this group learns (snapshot when the learn starts)."""
    devices: list[str] | None = None
    """Or these device ids."""
    model: str
    """Model name in the registry (e.g. digits-cnn)."""
    base: str
    """The upstream release round 1 fine-tunes from."""
    rounds: int = Field(ge=1, le=999)
    """Rounds to run; a round whose candidate is refused keeps its base for the next one."""
    data: str
    """Name of the labelled data set on each device (under its data_root) that the fine-tune
    trains on and the evaluation scores on (its held-out split)."""
    registry: str
    """Registry (folder, file://, http(s)://, s3://) that ``hpc-train aggregate`` reads the
    uploads from and ``hpc-train publish`` writes to: the one the devices pull from and
    upload to (their agent.yaml ``registry.url``), or the candidate cannot be evaluated."""
    trusted_keys: Path
    """Public keys (and NAME.scope files) that may sign the base and the devices' updates."""
    sign_key: Path
    """The upstream private key that signs candidates and releases."""
    version_prefix: str | None = None
    """Versions published: ``PREFIX-rK-candidate`` (what the devices evaluate) and
    ``PREFIX-rK`` (the release, only once the gates passed). Default: the learn's name."""
    release_versions: Literal["prefixed", "numbered"] = "prefixed"
    """How releases are named. ``prefixed``: ``PREFIX-rK``. ``numbered``: the base's number
    plus K, as upstream numbers its own (base 1: round 1 releases 2, round 2 releases 3; a
    refused round leaves its number unused); needs a numbered base. Candidates are
    ``PREFIX-rK-candidate`` either way. A number someone else published stops the learn."""
    work_dir: Path | None = None
    """Aggregates, device-evals files and tool logs, one folder per round (default: beside
    the db, ``DB.learn/NAME``)."""

    finetune: dict[str, Any] = Field(default_factory=dict)
    """More of the fine-tune command's args (``finetune.*``, ``export.*``, ``health.*``,
    ``steps.export``); the learn sets model, version, data and steps.upload itself."""
    eval_samples: int | None = Field(default=None, ge=1, le=100_000)
    """Held-out samples each device scores (null: its whole held-out split)."""
    eval_personal: list[Literal["head", "norm"]] = Field(default_factory=list, max_length=2)
    """Each device also scores the candidate personalized (comma list: head, norm): with its
    own model's head (FedPer) and/or normalization (FedBN) in its place; the round's report
    shows both scores. Not gated: the gates read the global candidate."""

    strategy: Literal["fedavg", "trimmed-mean", "median", "krum"] = "fedavg"
    """How ``hpc-train aggregate`` combines the deltas."""
    trim: float | None = Field(default=None, gt=0, lt=0.5)
    """trimmed-mean: fraction dropped at each end."""
    krum_f: int | None = Field(default=None, ge=0)
    """krum: Byzantine updates tolerated."""
    krum_keep: int | None = Field(default=None, ge=1)
    """krum: average the M best-scored updates (Multi-Krum; null: Krum's single pick)."""
    clip_norm: float | Literal["median"] | None = None
    """Clip each update's delta to this L2 norm, or to the round's median update norm
    ("median": an update scaled up counts as an ordinary one; no number to guess)."""
    server_lr: float = Field(default=1.0, gt=0, le=100)
    """Each aggregate is the base + this x the combined delta (1: plain averaging; at most
    100, as `hpc-train aggregate --server-lr` takes)."""
    dp_noise_multiplier: float | None = Field(default=None, gt=0)
    """Central Gaussian DP on fedavg (with clip_norm and dp_delta), DP-FedAvg's fixed
    denominator: the aggregate is sum of weight x clipped delta / dp_expected_weight, and the
    noise std this x clip_norm / dp_expected_weight; each aggregate's (epsilon, dp_delta) is
    accounted over the learn's rounds (every round releases one)."""
    dp_delta: float | None = Field(default=None, gt=0, lt=1)
    """DP: the delta of each aggregate's (epsilon, delta) guarantee, e.g. 1e-5 (below one over
    the number of devices); needed with dp_noise_multiplier."""
    dp_expected_weight: float | None = Field(default=None, gt=0)
    """DP: the total weight a round is expected to bring, each update weighing at most 1
    (null: the number of devices the learn targets, all of them at full weight; a round with
    fewer uploads takes a shorter step, never a less private one)."""
    dp_weight_cap: float | None = Field(default=None, gt=0)
    """DP: an update weighs min(its sample count / this, 1) (null: 1 each, whatever sample
    count a device claims)."""
    min_updates: int = Field(default=2, ge=1)
    """A round aggregates once this many devices' uploads are in (fresh ones and late ones
    within ``max_staleness``); fewer by ``collect_s``: the round is skipped, its base kept."""
    max_staleness: int = Field(default=0, ge=0, le=100)
    """Uploads fine-tuned from up to this many releases back still count (FedBuff weighting
    in ``hpc-train aggregate``); older ones are dropped."""
    first_updates: str | None = None
    """Round 1 combines the uploads of this fine-tune rollout, already run (``fleetctl rollout
    create --job finetune`` with ``steps.upload``, its devices on ``base``), instead of
    starting one: the devices' fine-tunes are not run twice. Later rounds start their own."""
    collect_s: float = Field(default=3600.0, gt=0)
    """Seconds from a round's fine-tune rollout to its aggregation at the latest: offline or
    slow devices do not hold a round; their uploads count in a later one."""

    min_devices: int = Field(default=1, ge=1)
    """Gate: fewer device evaluations of the candidate refuse it (always on: a candidate no
    device scored is never released)."""
    min_mean_gain: float | None = None
    """Gate: the devices' mean gain (candidate - base, percentage points) must reach this."""
    max_device_drop: float | None = Field(default=None, ge=0)
    """Gate: any device losing more points than this refuses the candidate."""
    gain_mean: Literal["devices", "samples"] | None = None
    """How the mean gain weighs devices (with min_mean_gain)."""
    max_upstream_drop: float | None = Field(default=None, ge=0)
    """Gate before any device sees the candidate: its accuracy on the upstream held-out split
    may drop this many points below the base's (needs base_checkpoint)."""
    base_checkpoint: Path | None = None
    """The checkpoint ``base`` was published from (max_upstream_drop); later rounds use the
    aggregate folder their base was published from."""
    eval_config: Path | None = None
    """Upstream training config whose data section the upstream gate scores on; needed from
    round 2 on (an aggregate's folder names no data)."""

    deploy: bool = False
    """Roll out ``deploy`` of each new release to the devices (else they keep their model;
    the next round fine-tunes from the release either way)."""
    waves: list[int | str] = Field(default_factory=lambda: ["100%"])
    """Waves of the fine-tune and deploy rollouts (the evaluation goes to all at once)."""
    bake_s: float = Field(default=0.0, ge=0)
    """Seconds the fine-tune and deploy rollouts wait after a healthy wave before the next."""
    max_per_minute: int | None = Field(default=None, gt=0)
    """Most commands each rollout of the round sends per minute (null: as fast as the broker
    takes them)."""
    abort_failure_rate: float = Field(default=0.5, ge=0, le=1)
    """Of the fine-tune and deploy rollouts (an evaluation never aborts: missing evaluations
    are the min_devices gate's business)."""
    min_completed: int = Field(default=5, ge=1)
    """Completed executions a rollout of the round needs before its failure rate is judged."""
    max_metric_drop: float | None = Field(default=None, ge=0)
    """Deploy rollout: abort when a wave's median drop of the devices' gate metric (eval/acc
    of a classifier) exceeds this."""
    timeout_s: float = Field(default=3600.0, gt=0)
    """Per device job (fine-tune, evaluate, deploy), from send to its result."""
    retries: int = Field(default=0, ge=0, le=10)
    """Extra attempts of a device's job after FAILED, TIMED_OUT or EXPIRED (REJECTED never)."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check_id(v, "learn name")
        if len(v) > MAX_NAME:
            raise ValueError(f"at most {MAX_NAME} characters (it names the learn's rollouts)")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        return check_model_name(v)

    @field_validator("base")
    @classmethod
    def _base(cls, v: str) -> str:
        return check_version(v)

    @field_validator("data")
    @classmethod
    def _data(cls, v: str) -> str:
        return check_id(v, "data set name")

    @field_validator("clip_norm", mode="before")
    @classmethod
    def _clip_norm(cls, v: Any) -> Any:
        if v is None or v == "median":
            return v
        try:
            x = math.nan if isinstance(v, bool) else float(v)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{v!r}: a positive L2 norm such as 4, or median (the round's "
                             "median update norm)")
        return x

    @field_validator("first_updates")
    @classmethod
    def _first_updates(cls, v: str | None) -> str | None:
        return v if v is None else check_id(v, "rollout name")

    @field_validator("waves", mode="before")
    @classmethod
    def _split_waves(cls, v: Any) -> Any:
        if isinstance(v, str):  # "1,25%,100%" from the command line
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("finetune")
    @classmethod
    def _finetune(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k in RESERVED_FINETUNE_ARGS:
            if k in v:
                raise ValueError(f"{k}: the learn sets it in every round")
        if "upload" in (v.get("steps") or {}):
            raise ValueError("steps.upload: the learn sets it (every round uploads)")
        return v

    @model_validator(mode="after")
    def _check(self) -> LearnPlan:
        if (self.group is None) == (self.devices is None):
            raise ValueError("give exactly one of group or devices")
        if self.min_mean_gain is None and self.max_device_drop is None:
            raise ValueError("set min_mean_gain or max_device_drop: without a device gate any "
                             "candidate would become a release")
        if self.gain_mean is not None and self.min_mean_gain is None:
            raise ValueError("gain_mean goes with min_mean_gain")
        if self.trim is not None and self.strategy != "trimmed-mean":
            raise ValueError("trim applies to strategy trimmed-mean only")
        if (self.krum_f is not None or self.krum_keep is not None) and self.strategy != "krum":
            raise ValueError("krum_f and krum_keep apply to strategy krum only")
        if self.dp_noise_multiplier is not None:
            if self.strategy != "fedavg" or not isinstance(self.clip_norm, float) \
                    or self.dp_delta is None:
                raise ValueError("dp_noise_multiplier needs strategy fedavg, a numeric "
                                 "clip_norm (the sensitivity; not median) and dp_delta (e.g. "
                                 "1e-5)")
        elif (self.dp_delta, self.dp_expected_weight, self.dp_weight_cap) != (None,) * 3:
            raise ValueError("dp_delta, dp_expected_weight and dp_weight_cap go with "
                             "dp_noise_multiplier")
        if self.max_upstream_drop is not None:
            if self.base_checkpoint is None:
                raise ValueError("max_upstream_drop needs base_checkpoint (the checkpoint "
                                 f"{self.base} was published from)")
            if self.rounds > 1 and self.eval_config is None:
                raise ValueError("max_upstream_drop over several rounds needs eval_config: a "
                                 "later base is an aggregate, whose folder names no data")
        elif self.base_checkpoint is not None or self.eval_config is not None:
            raise ValueError("base_checkpoint and eval_config go with max_upstream_drop")
        if self.release_versions == "numbered" and not self.base.isdigit():
            raise ValueError(f"release_versions numbered: the base must be a number like 1, "
                             f"got {self.base!r} (or use prefixed)")
        check_version(self.release_version(self.rounds, candidate=True))
        check_version(self.release_version(self.rounds))
        for phase in ROLLOUT_SUFFIX:  # every rollout a round makes validates now
            self.rollout_plan(phase, self.rounds, "0")  # type: ignore[arg-type]
        return self

    # --- what a round derives from the plan ---------------------------------------------

    def release_version(self, round_: int, *, candidate: bool = False) -> str:
        if self.release_versions == "numbered" and not candidate:
            return str(int(self.base) + round_)
        prefix = self.version_prefix or self.name
        return f"{prefix}-r{round_}" + ("-candidate" if candidate else "")

    def name_fix(self, version: str) -> str:
        """What to change when ``version``, which this learn would publish, is someone else's."""
        if self.release_versions == "numbered" and version.isdigit():
            return "start the learn from the newest numbered release, or set release_versions "\
                "prefixed"
        return "set version_prefix to a name no other learn used"

    def rollout_name(self, phase: Phase, round_: int) -> str:
        return f"{self.name}-r{round_}-{ROLLOUT_SUFFIX[phase]}"

    def job_args(self, phase: Phase, round_: int, base: str) -> dict[str, Any]:
        """The command args of a round's rollout: fine-tune ``base`` and upload; score the
        candidate beside ``base``; deploy the release."""
        if phase == "finetune":
            steps = {**(self.finetune.get("steps") or {}), "upload": True}
            return {**self.finetune, "model": self.model, "version": base, "data": self.data,
                    "steps": steps}
        if phase == "evaluate":
            ev: dict[str, Any] = {"baseline": base}
            if self.eval_samples is not None:
                ev["samples"] = self.eval_samples
            if self.eval_personal:
                ev["personal"] = list(self.eval_personal)
            return {"model": self.model, "version": self.release_version(round_, candidate=True),
                    "data": self.data, "evaluate": ev}
        return {"model": self.model, "version": self.release_version(round_), "data": self.data}

    def rollout_plan(self, phase: Phase, round_: int, base: str) -> RolloutPlan:
        knobs: dict[str, Any] = {
            "waves": self.waves, "bake_s": self.bake_s, "max_per_minute": self.max_per_minute,
            "abort_failure_rate": self.abort_failure_rate, "min_completed": self.min_completed,
            "timeout_s": self.timeout_s, "retries": self.retries,
        }
        if phase == "evaluate":
            # Scoring changes nothing on a device: no canary, and never an abort (the
            # min_devices gate judges how many answered).
            knobs.update(waves=["100%"], bake_s=0.0, abort_failure_rate=1.0,
                         rollback_on_abort=False)
        if phase == "deploy":
            knobs["max_metric_drop"] = self.max_metric_drop
        try:
            return RolloutPlan(name=self.rollout_name(phase, round_), group=self.group,
                               devices=self.devices, job=phase,
                               args=self.job_args(phase, round_, base), **knobs)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ValueError(f"the {phase} rollout would not validate: {where}: "
                             f"{err['msg'].removeprefix('Value error, ')}") from None


def validate_learn_plan(data: dict[str, Any], source: str = "learn plan") -> LearnPlan:
    try:
        return LearnPlan.model_validate(data)
    except ValidationError as e:
        raise PlanError(format_errors(e, source, LearnPlan)) from None


def load_learn_plan(path: Path | None, overrides: dict[str, Any]) -> LearnPlan:
    """A YAML plan file (or none), with command-line values laid over it."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise PlanError(f"{path}: cannot read the learn plan: {e}") from None
        if not isinstance(loaded, dict):
            raise PlanError(f"{path}: a plan is a mapping of fields, got "
                            f"{type(loaded).__name__}")
        data = loaded
    data.update(overrides)
    return validate_learn_plan(data, str(path) if path is not None else "learn start")
