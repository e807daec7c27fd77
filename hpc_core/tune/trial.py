"""One trial of an ``hpc-train tune`` study: its config (``trial_config``), its training run
with the pruning hook that reports each evaluation to Optuna, the heartbeat that tells other
workers it is alive, and ``attempt_trial``, which runs it and tells the study how it ended
(complete, pruned, failed, or interrupted by a stop signal).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_core.config import TrainConfig, config_from_dict
from hpc_core.tracking import TrialTracking, current_trial, trial_tracking
from hpc_core.tune.search_space import SearchSpace, apply_params, suggest

if TYPE_CHECKING:
    from hpc_core.tune.study_run import StudyRun

# Not imported: hpc_core.trainer (torch) until a trial runs; optuna until a command needs it.

log = logging.getLogger("hpc_core.tune")  # one logger for every part of `hpc-train tune`


class MetricNotReported(RuntimeError):
    """The study's metric is not among what the trainer's evaluation reports."""


class WorkerStopping(Exception):
    """The worker was asked to stop (SIGTERM, SIGUSR1) in the middle of a trial."""


def check_metric_reported(metric: str, step: int, metrics: dict[str, float]) -> None:
    """Raise MetricNotReported when this step evaluated but ``metric`` is not among what the
    evaluation reports: at the first evaluation, not after the whole run, since the objective
    is read from the final evaluation and no other name can ever give the trial a value."""
    evaluated = sorted(k for k in metrics if k.startswith("eval/"))
    if evaluated and metric not in evaluated:
        raise MetricNotReported(
            f"study.metric {metric!r} is not reported by the evaluation at step "
            f"{step} (it reports {', '.join(evaluated)}): fix study.metric in the space file"
        )


def trial_value(metrics: dict[str, float], metric: str, step: int) -> float:
    """The trial's value: ``metric`` of its final evaluation. MetricNotReported when the run
    reported none, ``TrainingDiverged`` when it is not finite (both backends fail the trial)."""
    from hpc_core.trainer import TrainingDiverged

    if metric not in metrics:
        raise MetricNotReported(
            f"the run reported no {metric!r}: set study.metric to an eval/* key"
        )
    value = metrics[metric]
    if not math.isfinite(value):
        raise TrainingDiverged(f"{metric} is {value} at step {step}")
    return value


class PruningHook:
    """Reports each evaluation of ``metric`` to the trial; asks the trainer to stop if pruned."""

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.pruned_at: int | None = None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        check_metric_reported(self.metric, step, metrics)
        if self.metric not in metrics or self.pruned_at is not None:
            return
        value = metrics[self.metric]
        self.trial.report(value if math.isfinite(value) else float("nan"), step)
        if self.trial.should_prune():
            self.pruned_at = step
            tracked = current_trial()
            if tracked is not None:
                tracked.state = "PRUNED"  # tagged on the trial's tracking runs as they close
            trainer.request_stop(f"pruned by optuna at step {step}")


def trial_config(base: TrainConfig, params: dict[str, Any], out: Path, number: int) -> TrainConfig:
    tree = apply_params(base.to_dict(), params)
    tree["run"]["output_dir"] = str(out / f"trial_{number:04d}")
    tree["run"]["name"] = f"{base.run.name}-trial{number}"
    tree["logging"]["progress"] = "off"
    # No rollback on a non-finite loss: a rollback scales the LR down, so the trial's value
    # would belong to other hyperparameters than the ones the sampler recorded for it.
    tree["faults"]["max_nan_rollbacks"] = 0
    if tree["logging"]["mlflow"] and tree["logging"]["mlflow_tracking_uri"] is None:
        # One store for the study: its parent run and every trial's run nested under it.
        tree["logging"]["mlflow_tracking_uri"] = f"sqlite:///{out.resolve()}/mlflow.db"
    return config_from_dict(tree, source=f"trial {number}")


def _run_trial(
    trial: Any,
    base: TrainConfig,
    space: SearchSpace,
    out: Path,
    worker: str,
    parent: StudyRun | None,
) -> float:
    """Train one trial and return its value; raise TrialPruned, WorkerStopping or the error
    that failed it."""
    import optuna

    from hpc_core.trainer import Trainer

    metric = space.study.metric
    trial.set_user_attr("worker", worker)
    cfg = trial_config(base, suggest(trial, space), out, trial.number)
    trial.set_user_attr("config", cfg.to_dict())
    hook = PruningHook(trial, metric)
    tracked = TrialTracking(
        study=trial.study.study_name,
        trial=trial.number,
        mlflow_parent_run_id=parent.run_id if parent is not None else None,
    )
    # The trial's tracking runs (opened by the trainer) belong to the study.
    with trial_tracking(tracked):
        trainer = Trainer(cfg, hooks=[hook])
        t0 = time.perf_counter()
        try:
            result = trainer.train()
        finally:
            trial.set_user_attr("seconds", round(time.perf_counter() - t0, 3))
            trial.set_user_attr("steps", trainer.state.step)
    if result.stopped_reason in ("SIGTERM", "SIGUSR1"):
        raise WorkerStopping(f"{result.stopped_reason} at step {result.final_step}")
    if hook.pruned_at is not None:
        raise optuna.TrialPruned(f"pruned at step {hook.pruned_at}")
    return trial_value(result.metrics, metric, result.final_step)


@contextlib.contextmanager
def _heartbeat(storage: Any, trial: Any) -> Iterator[None]:
    """Record the trial's heartbeat from a thread while it runs, so that other workers can tell
    a trial whose worker died (kill -9, the OOM killer) from a slow one. Optuna does this only
    inside ``study.optimize``; workers here use ask and tell."""
    interval = storage.get_heartbeat_interval()
    if interval is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.record_heartbeat(trial._trial_id)
            except Exception as e:  # a locked or restarting database: try again next beat
                log.warning("trial %d: heartbeat not recorded: %s", trial.number, e)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def attempt_trial(
    study: Any,
    storage: Any,
    trial: Any,
    base: TrainConfig,
    space: SearchSpace,
    out: Path,
    worker: str,
    parent: StudyRun | None = None,
) -> Any:
    """Run one trial and tell the study how it ended; return that state, or None when the
    worker must stop (a stop signal arrived during the trial)."""
    import optuna
    from optuna.trial import TrialState

    try:
        with _heartbeat(storage, trial):
            value = _run_trial(trial, base, space, out, worker, parent)
    except optuna.TrialPruned:
        study.tell(trial, state=TrialState.PRUNED)
        return TrialState.PRUNED
    except WorkerStopping as e:
        trial.set_user_attr("error", f"interrupted: {e}")
        study.tell(trial, state=TrialState.FAIL)
        log.warning("trial %d interrupted (%s): stopping this worker", trial.number, e)
        return None
    except KeyboardInterrupt:
        # As study.optimize does: the trial must not stay RUNNING, the interrupt goes on.
        trial.set_user_attr("error", "interrupted: KeyboardInterrupt")
        study.tell(trial, state=TrialState.FAIL)
        raise
    except Exception as e:
        trial.set_user_attr("error", f"{type(e).__name__}: {e}"[:2000])
        study.tell(trial, state=TrialState.FAIL)
        log.error("trial %d failed: %s: %s", trial.number, type(e).__name__, e, exc_info=True)
        del e  # its traceback holds the failed trainer: free its memory before the next trial
        _release_memory()
        return TrialState.FAIL
    study.tell(trial, value)
    return TrialState.COMPLETE


def _release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
