"""Search-space files for ``hpc-train tune``: validated like a config, sampled through Optuna.

A space file names the study's objective and pruner, and one distribution per config field::

    study:
      metric: eval/acc            # reported by the trainer at each evaluation
      direction: maximize
      pruner: median              # median | hyperband | none
    params:
      optimizer.lr: {type: float, low: 1.0e-4, high: 0.3, log: true}
      model.kwargs.width: {type: categorical, choices: [8, 16, 32]}
      training.global_batch_size: {type: int, low: 32, high: 128, step: 32}

Parameter names are dotted config paths (the same as ``--set``); each must address a field of
the training config (any key under ``model.kwargs``). Errors name the path and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hpc_core.config import ConfigError, TrainConfig, read_yaml
from registry.validation import format_errors


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FloatParam(_Strict):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    """Sample uniformly in log space (learning rates, weight decay)."""
    step: float | None = Field(default=None, gt=0.0)
    """Discretisation step (not with log)."""

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        _check_range(self.low, self.high, self.log)
        if self.log and self.step is not None:
            raise ValueError("step and log cannot be combined: drop one of them")
        return self


class IntParam(_Strict):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_range(self.low, self.high, self.log)
        if self.log and self.step != 1:
            raise ValueError("step and log cannot be combined: drop one of them")
        return self


class CategoricalParam(_Strict):
    type: Literal["categorical"]
    choices: list[bool | int | float | str | None] = Field(min_length=1)
    """Values to choose from (scalars only: Optuna stores them in the study database)."""


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class StudyConfig(_Strict):
    name: str | None = None
    """Study name in the storage (null = the config's run.name)."""
    metric: str = "eval/acc"
    """Evaluation metric to optimise (eval/acc or eval/loss); reported at every evaluation to
    the pruner. A name the evaluation does not report fails the trial at its first one."""
    direction: Literal["maximize", "minimize"] = "maximize"
    sampler: Literal["tpe", "random"] = "tpe"
    pruner: Literal["median", "hyperband", "none"] = "median"
    seed: int | None = 0
    """Sampler seed; each worker adds its own offset so workers do not propose alike."""
    n_startup_trials: int = Field(default=2, ge=0)
    """Trials sampled at random (TPE) and never pruned (median) before the model kicks in."""
    n_warmup_steps: int = Field(default=0, ge=0)
    """Median pruner: optimizer steps before a trial may be pruned."""
    max_consecutive_failures: int = Field(default=3, ge=1)
    """A worker stops after this many of its trials failed in a row (a broken base config or a
    mistyped metric fails every trial); failed trials do not count toward --trials."""
    heartbeat_s: int | None = Field(default=60, ge=1)
    """Seconds between a running trial's heartbeats in the storage; a trial silent for twice
    as long (its worker was killed) is marked failed and its slot goes to another trial.
    null = no heartbeat: a killed worker's trial stays running."""


class SearchSpace(_Strict):
    study: StudyConfig = Field(default_factory=StudyConfig)
    params: dict[str, Param] = Field(min_length=1)
    """Dotted config path -> distribution."""


def _check_range(low: float, high: float, log: bool) -> None:
    if not low < high:
        raise ValueError(f"low ({low}) must be below high ({high})")
    if log and low <= 0:
        raise ValueError(f"log=true needs low > 0 (got {low})")


def _check_paths(space: SearchSpace) -> list[str]:
    """Every parameter must name a config field; model.kwargs.* is free-form."""
    errors = []
    for path in space.params:
        parts = path.split(".")
        if parts[:2] == ["model", "kwargs"] and len(parts) == 3:
            continue
        model: type[BaseModel] = TrainConfig
        for i, part in enumerate(parts):
            field = model.model_fields.get(part)
            if field is None:
                where = ".".join(parts[:i]) or "the config"
                known = ", ".join(model.model_fields)
                errors.append(f"  params.{path}: {where} has no key {part!r} (known: {known})")
                break
            ann = field.annotation
            if i < len(parts) - 1 and not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                errors.append(
                    f"  params.{path}: {'.'.join(parts[: i + 1])} is a value, not a section"
                )
                break
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                model = ann
            elif i == len(parts) - 1:
                break
        else:
            errors.append(f"  params.{path}: names a section, not a value")
    return errors


def load_space(path: Path | str) -> SearchSpace:
    """Read and validate a space file; raise ConfigError listing every error with its path."""
    tree = read_yaml(Path(path))
    try:
        space = SearchSpace.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(str(path), format_errors(e, SearchSpace)) from None
    errors = _check_paths(space)
    if errors:
        raise ConfigError(str(path), errors)
    return space


def suggest(trial: Any, space: SearchSpace) -> dict[str, Any]:
    """Sample one value per parameter from an ``optuna.Trial``; keys are dotted config paths."""
    out: dict[str, Any] = {}
    for name, p in space.params.items():
        if isinstance(p, FloatParam):
            out[name] = trial.suggest_float(name, p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            out[name] = trial.suggest_int(name, p.low, p.high, log=p.log, step=p.step)
        else:
            out[name] = trial.suggest_categorical(name, p.choices)
    return out


def distributions(space: SearchSpace) -> dict[str, Any]:
    """The space as Optuna distributions, keyed by dotted config path: what ``suggest`` samples,
    for samplers that ask with fixed distributions (Ray Tune's ``OptunaSearch``)."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    out: dict[str, Any] = {}
    for name, p in space.params.items():
        if isinstance(p, FloatParam):
            out[name] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            out[name] = IntDistribution(p.low, p.high, log=p.log, step=p.step)
        else:
            out[name] = CategoricalDistribution(p.choices)
    return out


def apply_params(tree: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Set each dotted path in a config tree (like ``--set``, but with typed values)."""
    for path, value in params.items():
        node = tree
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree
