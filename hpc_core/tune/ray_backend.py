"""``hpc-train tune --backend ray``: the same study on a Ray cluster, through Ray Tune.

The search space, the objective, the trial (one ``hpc_core.Trainer`` run of ``trial_config``)
and the reports are the Optuna backend's; Ray places the trials. The searcher is Ray's
``OptunaSearch`` over the space's Optuna distributions (the space's sampler: TPE with constant
liar, or random), capped at as many running trials as the cluster holds at once
(``ConcurrencyLimiter``: TPE learns nothing from trials proposed before any has finished). The
space's pruner becomes ``ASHAScheduler`` (median or hyperband) on the trainer's optimizer step,
its maximum the real step count as the Optuna backend's Hyperband takes it, or no scheduler
(none).

Each evaluation is reported with ``ray.tune.report(metrics, checkpoint=...)``, the checkpoint
being the trial's own safetensors checkpoint directory of that step (Ray copies it into the
experiment; no model state is pickled). A trial Ray restores (a killed driver's experiment
restored, a trial resumed) loads the last one it reported and continues exactly where it was.

The failure rules are the Optuna backend's: a trial that raises (it diverges, its metric is not
reported, its config is invalid, it runs out of memory) ends ERROR and a new trial replaces it
(``--trials`` counts complete and pruned trials), a non-finite loss fails the trial at once
(``faults.max_nan_rollbacks=0``), and after ``study.max_consecutive_failures`` failures in a
row no new trial starts (exit 1).

Processes: a trial's Ray worker runs the next trial placed on it (``reuse_actors``), so torch
and the trainer are imported once per worker, by the workers' setup hook (``ray_worker``), not
once per trial. Tracking: the study's MLflow parent run (``study_run``) is opened before the
search and closed after it; each trial's runs are nested under it.

State: the Ray experiment lives in ``OUT/ray/STUDY``. A command that finds it there restores it
(``Tuner.restore``): finished and failed trials stay as they are, the trials that were running
resume from their last checkpoint, and the search goes on to the original ``--trials``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import ConcurrencyLimiter, Searcher
from ray.tune.search.optuna import OptunaSearch

from hpc_core.config import TrainConfig, config_from_dict
from hpc_core.tune.ray_results import results_study
from hpc_core.tune.ray_trial import TRIAL_KEY, ray_trial
from hpc_core.tune.ray_worker import WORKER_SETUP_HOOK
from hpc_core.tune.report import summary_markdown, write_reports
from hpc_core.tune.search_space import (
    CategoricalParam,
    SearchSpace,
    apply_params,
    distributions,
)
from hpc_core.tune.study_run import StudyRun, close_study_run, open_study_run
from hpc_core.tune.worker import STEP_COUNT_FIELDS, hyperband_max_resource, make_sampler

# ray is an optional extra: ``hpc_core.tune.command`` imports this module only for
# ``--backend ray`` (and says how to install it). Not imported: hpc_core.trainer (torch) until
# a trial runs.

log = logging.getLogger("hpc_core.tune")  # one logger for every part of `hpc-train tune`

# Ray reads it when a trial's actor starts: the trial keeps the driver's working directory, so
# relative paths of the config mean on a trial what they mean on the command line.
_WORKER_ENV = {"RAY_CHDIR_TO_TRIAL_DIR": "0", "TUNE_FUNCTION_THREAD_TIMEOUT_S": "120"}


def study_name(args: argparse.Namespace, base: TrainConfig, space: SearchSpace) -> str:
    return args.study_name or space.study.name or base.run.name


def run_ray(args: argparse.Namespace, base: TrainConfig, space: SearchSpace, out: Path) -> int:
    """Run (or restore) the experiment, write the reports; the command's exit status."""
    if args.storage is not None:
        print(
            "--storage is the optuna backend's: the ray backend keeps its experiment under "
            f"{out}/ray",
            file=sys.stderr,
        )
        return 2
    if args.cpus_per_trial <= 0 or args.gpus_per_trial < 0:
        print("--cpus-per-trial must be above 0 and --gpus-per-trial at least 0", file=sys.stderr)
        return 2
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # The experiment state is saved this often (Ray's default: at least every 10 s). A killed
    # driver loses at most that much bookkeeping; a trial it lost track of resumes from its
    # last checkpoint.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    # Ray warns when it saves that state often: here it is meant (and small).
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Ray's own summary tables would interleave with ours: our trial log lines and summary.md.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # The study's MLflow parent run (logging.mlflow): found again when the experiment is
    # restored.
    parent = open_study_run(base, out, study_name(args, base, space))
    started = not ray.is_initialized()
    if started:
        _connect(args.address)
    try:
        grid = _fit(args, base, space, out, parent)
    finally:
        if started:
            ray.shutdown()
    study = results_study(grid, base, space, out, study_name(args, base, space))
    metric = space.study.metric
    print(summary_markdown(study, metric), end="")
    # The search ends short of --trials complete or pruned trials only when it stopped after
    # too many failures in a row.
    failed = sum(t.state.name != "FAIL" for t in study.trials) < args.trials
    if failed:
        print(
            f"stopped after {space.study.max_consecutive_failures} failed trials in a row: "
            "see each trial's error above",
            file=sys.stderr,
        )
    best = write_reports(study, metric, out)
    if parent is not None:
        close_study_run(parent, study, metric, status="FAILED" if failed else "FINISHED")
    if best is None:
        print("no trial completed", file=sys.stderr)
        return 1
    print(f"best config: {best}\nhistory: {out / 'history.png'}")
    return 1 if failed else 0


def _connect(address: str | None) -> None:
    runtime_env = {"env_vars": dict(_WORKER_ENV), "worker_process_setup_hook": WORKER_SETUP_HOOK}
    if address is None:
        # A fresh Ray on this machine, never one that happens to run here already.
        ray.init(
            address="local",
            include_dashboard=False,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
        )
        return
    ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)


def _fit(
    args: argparse.Namespace,
    base: TrainConfig,
    space: SearchSpace,
    out: Path,
    parent: StudyRun | None,
) -> Any:
    name = study_name(args, base, space)
    storage = out / "ray"
    resources = {"cpu": args.cpus_per_trial, "gpu": args.gpus_per_trial}
    trainable = tune.with_resources(
        tune.with_parameters(
            ray_trial,
            base=base.to_dict(),
            metric=space.study.metric,
            out=str(out),
            study=name,
            parent_run_id=parent.run_id if parent is not None else None,
        ),
        resources,
    )
    experiment = storage / name
    if tune.Tuner.can_restore(str(experiment)):
        log.info("restoring the ray experiment in %s", experiment)
        tuner = tune.Tuner.restore(
            str(experiment),
            trainable,
            resume_unfinished=True,
            # Failed trials stay failed: the searcher has replaced them already.
            resume_errored=False,
            restart_errored=False,
        )
        return tuner.fit()
    budget = TrialBudget(
        _searcher(space, resources),
        trials=args.trials,
        max_consecutive_failures=space.study.max_consecutive_failures,
    )
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=budget,
            scheduler=_scheduler(base, space),
            num_samples=-1,  # the budget decides when the search is done
            # A trial's process (its imports done: torch alone takes seconds) runs the next
            # trial; a stopped trial ends before the next one starts (ray_trial).
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=str(storage),
            failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
            # Every reported checkpoint is kept (one per evaluation): Ray deletes the older ones
            # as new ones come in, and a driver killed before its next state save would leave
            # a state naming a deleted one, a trial that cannot be restored.
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
            callbacks=[_TrialLog(space.study.metric)],
            verbose=0,
        ),
    )
    return tuner.fit()


# -------------------------------------------------------------------------------------------
# Searcher and scheduler


def _searcher(space: SearchSpace, resources: dict[str, float]) -> Searcher:
    s = space.study
    search = OptunaSearch(
        space=distributions(space),
        metric=s.metric,
        mode="max" if s.direction == "maximize" else "min",
        sampler=make_sampler(space, 0),
    )
    return ConcurrencyLimiter(search, max_concurrent=_fits_at_once(resources))


def _fits_at_once(resources: dict[str, float]) -> int:
    """How many trials the cluster runs at once (at least one)."""
    have = ray.cluster_resources()
    fits = [int(have.get(key.upper(), 0.0) / need + 1e-9) for key, need in resources.items()
            if need > 0]  # fmt: skip
    return max(1, min(fits)) if fits else 1


def asha_max_t(base: TrainConfig, space: SearchSpace) -> int:
    """ASHA's maximum step: a full trial's optimizer steps, as the Optuna backend's Hyperband
    takes them; when the space tunes the step count, its longest trial's."""
    steps = hyperband_max_resource(base, space)
    if isinstance(steps, int):
        return steps
    extremes: dict[str, Any] = {}
    for field in STEP_COUNT_FIELDS:
        p = space.params.get(field)
        if p is None:
            continue
        values = [v for v in (p.choices if isinstance(p, CategoricalParam) else [p.low, p.high])
                  if isinstance(v, (int, float))]  # fmt: skip
        if values:
            # The most steps: the most epochs or steps, the smallest batch.
            extremes[field] = min(values) if field.endswith("batch_size") else max(values)
    longest = config_from_dict(apply_params(base.to_dict(), extremes), source="longest trial")
    rest = {k: v for k, v in space.params.items() if k not in STEP_COUNT_FIELDS}
    steps = hyperband_max_resource(longest, space.model_copy(update={"params": rest}))
    assert isinstance(steps, int)
    return steps


def _scheduler(base: TrainConfig, space: SearchSpace) -> FIFOScheduler:
    s = space.study
    if s.pruner == "none":
        return FIFOScheduler()
    max_t = asha_max_t(base, space)
    return ASHAScheduler(
        time_attr="step",
        metric=s.metric,
        mode="max" if s.direction == "maximize" else "min",
        max_t=max_t,
        # The median pruner's warm-up: no trial is stopped before this step.
        grace_period=max(1, min(s.n_warmup_steps, max_t)),
        reduction_factor=3,  # Optuna's Hyperband default
    )


class TrialBudget(Searcher):
    """Wraps the searcher: numbers the trials, stops proposing once ``trials`` of them are
    complete, pruned or running (a failed one is replaced), or after
    ``max_consecutive_failures`` failures in a row. Its state (``get_state``) is saved with the
    experiment, so a restored experiment keeps counting."""

    def __init__(self, searcher: Any, *, trials: int, max_consecutive_failures: int) -> None:
        self.searcher = searcher
        self.trials = trials
        self.max_consecutive_failures = max_consecutive_failures
        self.numbers = {}
        self.finished = set()
        self.failed = set()
        self.failures_in_a_row = 0
        self.stopped = False
        super().__init__(metric=searcher.metric, mode=searcher.mode)

    def set_search_properties(
        self, metric: str | None, mode: str | None, config: dict[str, Any], **spec: Any
    ) -> bool:
        return self.searcher.set_search_properties(metric, mode, config, **spec)

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:  # type: ignore[override]
        running = len(self.numbers) - len(self.finished)
        if self.stopped:
            return Searcher.FINISHED
        if len(self.numbers) - len(self.failed) >= self.trials:
            # A running trial may still fail and need a replacement: done once none runs.
            return Searcher.FINISHED if running == 0 else None
        suggestion = self.searcher.suggest(trial_id)
        if suggestion is None or suggestion == Searcher.FINISHED:
            return suggestion
        self.numbers[trial_id] = len(self.numbers)
        return {**suggestion, TRIAL_KEY: self.numbers[trial_id]}

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        self.searcher.on_trial_result(trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        if trial_id not in self.numbers or trial_id in self.finished:
            return
        self.finished.add(trial_id)
        if error:
            self.failed.add(trial_id)
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.max_consecutive_failures:
                log.error(
                    "no new trial: the last %d failed (study.max_consecutive_failures); the "
                    "errors are in the log above and in summary.md",
                    self.failures_in_a_row,
                )
                self.stopped = True
            # Without its last result: Ray's OptunaSearch would record a failed trial that
            # reported anything as complete with that value.
            self.searcher.on_trial_complete(trial_id, result=None, error=True)
            return
        self.failures_in_a_row = 0
        if not (result or {}).get("final"):
            # Stopped by the scheduler before its last step: PRUNED to the sampler, as the
            # Optuna backend records a pruned trial. With its last result, Ray's OptunaSearch
            # records it COMPLETE at its early score, and TPE learns that the parameters of
            # every trial stopped early (during the warm-up: at chance) are bad.
            self.searcher.on_trial_complete(trial_id, result=None, error=False)
            return
        self.searcher.on_trial_complete(trial_id, result=result, error=False)

    def get_state(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["searcher"]
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def save(self, checkpoint_path: str) -> None:
        self.searcher.save(checkpoint_path)

    def restore(self, checkpoint_path: str) -> None:
        self.searcher.restore(checkpoint_path)


class _TrialLog(tune.Callback):
    """One log line per trial end (Ray's own progress output is off)."""

    def __init__(self, metric: str) -> None:
        self.metric = metric

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        last = trial.last_result or {}
        log.info(
            "trial %s %s at step %s: %s=%s",
            trial.config.get(TRIAL_KEY), "complete" if last.get("final") else "pruned",
            last.get("step"), self.metric, last.get(self.metric),
        )  # fmt: skip

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        log.error(
            "trial %s failed: its error is in summary.md, its traceback in %s",
            trial.config.get(TRIAL_KEY), getattr(trial, "error_file", None) or trial.path,
        )  # fmt: skip
