"""An ``hpc-train tune`` worker: it joins the study (its sampler and pruner built from the
search space's ``study`` section) and runs trials until the study holds ``--trials`` live ones,
replacing failed trials, or until too many of its own fail in a row (``run_worker``).
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpc_core.config import TrainConfig
from hpc_core.tune.search_space import SearchSpace
from hpc_core.tune.storage import make_storage
from hpc_core.tune.study_run import StudyRun, open_study_run
from hpc_core.tune.trial import attempt_trial

# Not imported: hpc_core.trainer (torch) until a worker runs; optuna until a command needs it.

log = logging.getLogger("hpc_core.tune")  # one logger for every part of `hpc-train tune`


def make_sampler(space: SearchSpace, worker_index: int) -> Any:
    import optuna

    s = space.study
    seed = None if s.seed is None else s.seed + 1000 * worker_index
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar: a running trial counts as a poor result, so parallel workers spread out.
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=s.n_startup_trials, constant_liar=True
    )


def _pruner(space: SearchSpace, base: TrainConfig) -> Any:
    import optuna

    s = space.study
    if s.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=s.n_startup_trials, n_warmup_steps=s.n_warmup_steps
        )
    if s.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=1, max_resource=hyperband_max_resource(base, space)
        )
    return optuna.pruners.NopPruner()


# Trial parameters that change how many optimizer steps a trial runs.
STEP_COUNT_FIELDS = ("training.max_steps", "training.epochs", "training.global_batch_size")


def hyperband_max_resource(base: TrainConfig, space: SearchSpace) -> int | str:
    """Hyperband's maximum resource: the optimizer steps of one full trial (the unit of every
    report), or "auto" (Optuna takes the first finished trial's) when the space changes it.
    A guess too large (10**6 for a 264-step run) adds brackets whose rungs no trial reaches."""
    if any(f in space.params for f in STEP_COUNT_FIELDS):
        return "auto"
    t = base.training
    if t.max_steps is not None:
        return t.max_steps
    from hpc_core.data import build_datasets, steps_per_epoch

    _, _, info = build_datasets(base.data)
    return (t.epochs or 1) * steps_per_epoch(info.num_train, t.global_batch_size)


def _fail_stale_trials(study: Any) -> None:
    """Mark failed the running trials whose heartbeat stopped (no-op without heartbeats)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def _live(study: Any) -> list[Any]:
    """Trials that count toward --trials: finished (complete, pruned), running or queued."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.FAIL]


@dataclass
class WorkerResult:
    study: Any
    stopped: Literal["done", "failures", "signal"]
    """done: the study holds --trials live trials; failures: max_consecutive_failures in a row;
    signal: SIGTERM/SIGUSR1 arrived during a trial."""
    finished: bool
    """No trial of the study is running any more: this worker writes the reports."""
    parent: StudyRun | None = None
    """The study's MLflow parent run (logging.mlflow), shared by every worker."""


def run_worker(
    base: TrainConfig,
    space: SearchSpace,
    *,
    trials: int,
    storage: str,
    out: Path,
    study_name: str | None = None,
    worker_index: int = 0,
) -> WorkerResult:
    """Run trials until the study holds ``trials`` finished or running ones (failed trials
    are replaced), or until ``study.max_consecutive_failures`` of this worker's fail in a row."""
    import optuna
    from optuna.trial import TrialState

    out.mkdir(parents=True, exist_ok=True)
    rdb = make_storage(storage, heartbeat_s=space.study.heartbeat_s)
    study = optuna.create_study(
        study_name=study_name or space.study.name or base.run.name,
        storage=rdb,
        direction=space.study.direction,
        sampler=make_sampler(space, worker_index),
        pruner=_pruner(space, base),
        load_if_exists=True,
    )
    parent = open_study_run(base, out, study.study_name)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    stopped: Literal["done", "failures", "signal"] = "done"
    failures = 0
    while True:
        _fail_stale_trials(study)
        if len(_live(study)) >= trials:
            break
        with warnings.catch_warnings():
            # Optuna's heartbeat thread runs only in study.optimize; ours is trial._heartbeat.
            warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
            trial = study.ask()
        if sum(t.number < trial.number for t in _live(study)) >= trials:
            # Another worker took the last slot between our count and our ask.
            trial.set_user_attr("surplus", True)
            study.tell(trial, state=TrialState.FAIL)
            break
        state = attempt_trial(study, rdb, trial, base, space, out, worker, parent)
        if state is None:
            stopped = "signal"
            break
        failures = failures + 1 if state == TrialState.FAIL else 0
        if failures >= space.study.max_consecutive_failures:
            log.error(
                "stopping this worker: its last %d trials failed (study.max_consecutive_failures)"
                "; the errors are in the log above and in summary.md",
                failures,
            )
            stopped = "failures"
            break
    running = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
    return WorkerResult(study, stopped, finished=not running, parent=parent)
