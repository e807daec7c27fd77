"""Hyperparameter search with Optuna: ``hpc-train tune``.

Each ``hpc-train tune`` process is one worker. Workers on any number of machines share one
study through its storage (``sqlite:///study.db`` on one machine or a shared disk,
``postgresql://...`` for many), so a Slurm array or a Kubernetes Job of N pods is N workers.
``--trials`` is the study's total, not each worker's: a worker stops once the study holds that
many finished (complete or pruned) or running trials. Every trial is a real training run
(``hpc_core.Trainer``) whose evaluations are reported to the pruner through a trainer hook; a
pruned trial checkpoints and stops at the next step.

When a trial goes wrong (it diverges, its metric is not reported, it runs out of memory, its
config is invalid) it ends FAILED in the study with the error in its ``error`` user attribute
and the traceback in the worker's log, and the worker starts another trial in its place: failed
trials do not count toward ``--trials``. A worker stops after
``study.max_consecutive_failures`` failures in a row. A worker killed outright (kill -9, the
kernel's OOM killer) stops sending its trial's heartbeat; other workers mark that trial failed.

Outputs under ``--out``: ``trial_NNNN/`` (each trial's run), and once no trial of the study is
running any more (the last worker to finish writes them): ``best_config.yaml`` (the best
trial's resolved config, ready for ``hpc-train train``), ``summary.md`` and ``history.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import math
import os
import random
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from hpc_core.atomic import write_bytes_atomic
from hpc_core.config import ConfigError, TrainConfig, config_from_dict, load_config
from hpc_core.logs import setup_logging
from hpc_core.search_space import SearchSpace, apply_params, load_space, suggest

# Not imported: hpc_core.trainer (torch) until a worker runs; optuna until a command needs it.

log = logging.getLogger(__name__)


class MetricNotReported(RuntimeError):
    """The study's metric is not among what the trainer's evaluation reports."""


class WorkerStopping(Exception):
    """The worker was asked to stop (SIGTERM, SIGUSR1) in the middle of a trial."""


class PruningHook:
    """Reports each evaluation of ``metric`` to the trial; asks the trainer to stop if pruned."""

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.pruned_at: int | None = None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        evaluated = sorted(k for k in metrics if k.startswith("eval/"))
        if evaluated and self.metric not in evaluated:
            # At the first evaluation, not after the whole run: the objective is read from the
            # final evaluation, so no other name can ever give the trial a value.
            raise MetricNotReported(
                f"study.metric {self.metric!r} is not reported by the evaluation at step "
                f"{step} (it reports {', '.join(evaluated)}): fix study.metric in the space file"
            )
        if self.metric not in metrics or self.pruned_at is not None:
            return
        value = metrics[self.metric]
        self.trial.report(value if math.isfinite(value) else float("nan"), step)
        if self.trial.should_prune():
            self.pruned_at = step
            trainer.request_stop(f"pruned by optuna at step {step}")


# Workers started together (a Slurm array, a Kubernetes Job) all open a fresh study's database
# at once, and Optuna's first open is several separate writes: the tables, the version row, the
# alembic stamp. Each one's loser gets "table ... already exists", an IntegrityError on a
# duplicate row or, on SQLite, "database is locked". So first opens are serialised (a flock
# beside a SQLite file, an advisory lock on PostgreSQL) and retried with a bounded back-off for
# what the lock cannot cover (a shared disk without flock, another engine, a server starting).
STORAGE_ATTEMPTS = 8
_PG_INIT_LOCK_KEY = 0x65646774  # any constant, the same in every worker


def make_storage(
    url: str, *, attempts: int = STORAGE_ATTEMPTS, heartbeat_s: int | None = None
) -> Any:
    """An Optuna RDB storage at ``url``; safe when many workers open a fresh one at once.
    ``heartbeat_s``: running trials record a heartbeat this often (see ``_heartbeat``)."""
    import optuna
    from sqlalchemy import exc

    # SQLite serialises writers: wait for the lock instead of failing when workers collide.
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    if url.startswith("postgresql://"):
        # SQLAlchemy 2.1 defaults to psycopg 3; the tracking extra ships psycopg2.
        url = "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    for attempt in range(1, attempts + 1):
        try:
            with _first_open_lock(url), warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url, engine_kwargs=kwargs, heartbeat_interval=heartbeat_s
                )
        except (exc.IntegrityError, exc.OperationalError, exc.ProgrammingError) as e:
            if attempt == attempts or (
                isinstance(e, exc.ProgrammingError) and "already exists" not in str(e)
            ):
                raise
            # Jitter: workers that collided once must not wake up together again.
            delay = min(2.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.5)
            log.warning(
                "opening the study storage failed (attempt %d of %d), retrying in %.2f s: %s",
                attempt, attempts, delay, str(e).splitlines()[0],
            )  # fmt: skip
            time.sleep(delay)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _first_open_lock(url: str) -> Iterator[None]:
    """Hold the lock that serialises opening the storage: a flock on ``DB.lock`` beside a
    SQLite file, a session advisory lock on PostgreSQL, none elsewhere. A dead holder's lock
    goes with its process or connection, so a killed worker never blocks the others."""
    import sqlalchemy

    parsed = sqlalchemy.engine.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        # NullPool: closing the connection ends the server session, and the lock with it.
        engine = sqlalchemy.create_engine(parsed, poolclass=sqlalchemy.pool.NullPool)
        try:
            with engine.connect() as conn:
                conn.execute(
                    sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _PG_INIT_LOCK_KEY}
                )
                yield
        finally:
            engine.dispose()
        return
    fd = None
    if backend == "sqlite" and parsed.database and parsed.database != ":memory:":
        try:
            fd = os.open(f"{parsed.database}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            # No such folder (SQLite will say so), read-only, or no flock on this file
            # system: go on unlocked, the retries still cover.
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock


def _sampler(space: SearchSpace, worker_index: int) -> Any:
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
_STEP_COUNT_FIELDS = ("training.max_steps", "training.epochs", "training.global_batch_size")


def hyperband_max_resource(base: TrainConfig, space: SearchSpace) -> int | str:
    """Hyperband's maximum resource: the optimizer steps of one full trial (the unit of every
    report), or "auto" (Optuna takes the first finished trial's) when the space changes it.
    A guess too large (10**6 for a 264-step run) adds brackets whose rungs no trial reaches."""
    if any(f in space.params for f in _STEP_COUNT_FIELDS):
        return "auto"
    t = base.training
    if t.max_steps is not None:
        return t.max_steps
    from hpc_core.data import build_datasets, steps_per_epoch

    _, _, info = build_datasets(base.data)
    return (t.epochs or 1) * steps_per_epoch(info.num_train, t.global_batch_size)


def trial_config(base: TrainConfig, params: dict[str, Any], out: Path, number: int) -> TrainConfig:
    tree = apply_params(base.to_dict(), params)
    tree["run"]["output_dir"] = str(out / f"trial_{number:04d}")
    tree["run"]["name"] = f"{base.run.name}-trial{number}"
    tree["logging"]["progress"] = "off"
    # No rollback on a non-finite loss: a rollback scales the LR down, so the trial's value
    # would belong to other hyperparameters than the ones the sampler recorded for it.
    tree["faults"]["max_nan_rollbacks"] = 0
    return config_from_dict(tree, source=f"trial {number}")


def _run_trial(trial: Any, base: TrainConfig, space: SearchSpace, out: Path, worker: str) -> float:
    """Train one trial and return its value; raise TrialPruned, WorkerStopping or the error
    that failed it."""
    import optuna

    from hpc_core.trainer import Trainer, TrainingDiverged

    metric = space.study.metric
    trial.set_user_attr("worker", worker)
    cfg = trial_config(base, suggest(trial, space), out, trial.number)
    trial.set_user_attr("config", cfg.to_dict())
    hook = PruningHook(trial, metric)
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
    if metric not in result.metrics:
        raise MetricNotReported(
            f"the run reported no {metric!r}: set study.metric to an eval/* key"
        )
    value = result.metrics[metric]
    if not math.isfinite(value):
        raise TrainingDiverged(f"{metric} is {value} at step {result.final_step}")
    return value


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


def _attempt(
    study: Any,
    storage: Any,
    trial: Any,
    base: TrainConfig,
    space: SearchSpace,
    out: Path,
    worker: str,
) -> Any:
    """Run one trial and tell the study how it ended; return that state, or None when the
    worker must stop (a stop signal arrived during the trial)."""
    import optuna
    from optuna.trial import TrialState

    try:
        with _heartbeat(storage, trial):
            value = _run_trial(trial, base, space, out, worker)
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
        sampler=_sampler(space, worker_index),
        pruner=_pruner(space, base),
        load_if_exists=True,
    )
    worker = f"{socket.gethostname()}:{os.getpid()}"
    stopped: Literal["done", "failures", "signal"] = "done"
    failures = 0
    while True:
        _fail_stale_trials(study)
        if len(_live(study)) >= trials:
            break
        with warnings.catch_warnings():
            # Optuna's heartbeat thread runs only in study.optimize; ours is _heartbeat.
            warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
            trial = study.ask()
        if sum(t.number < trial.number for t in _live(study)) >= trials:
            # Another worker took the last slot between our count and our ask.
            trial.set_user_attr("surplus", True)
            study.tell(trial, state=TrialState.FAIL)
            break
        state = _attempt(study, rdb, trial, base, space, out, worker)
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
    return WorkerResult(study, stopped, finished=not running)


def counted(study: Any) -> list[Any]:
    """The study's trials, less the surplus asks that lost a race for the last slot."""
    return [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]


def summary_markdown(study: Any, metric: str) -> str:
    trials = counted(study)
    states = [t.state.name.lower() for t in trials]
    tally = ", ".join(f"{states.count(s)} {s}" for s in ("complete", "pruned", "fail", "running"))
    lines = [
        f"{tally} (study {study.study_name!r})",
        "",
        f"| trial | state | {metric} | steps | seconds | worker | params | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in trials:
        value = t.value
        if value is None and t.intermediate_values:
            value = t.intermediate_values[max(t.intermediate_values)]
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t.params.items())
        lines.append(
            f"| {t.number} | {t.state.name.lower()} | "
            f"{'' if value is None else f'{value:.4f}'} | {t.user_attrs.get('steps', '')} | "
            f"{t.user_attrs.get('seconds', '')} | {t.user_attrs.get('worker', '')} | {params} | "
            f"{_error(t)} |"
        )
    return "\n".join(lines) + "\n"


def _error(t: Any) -> str:
    """A failed trial's error, first line, fit for a table cell."""
    from optuna.trial import TrialState

    if t.state != TrialState.FAIL:
        return ""
    # A trial failed by another worker's stale-heartbeat check carries no error of its own.
    text = t.user_attrs.get("error") or "no heartbeat: its worker died"
    first = text.splitlines()[0]
    if len(first) > 160:
        first = first[:157] + "..."
    return first.replace("|", "\\|")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_reports(study: Any, metric: str, out: Path) -> Path | None:
    """best_config.yaml, summary.md and history.png; returns the best config's path."""
    from optuna.trial import TrialState

    write_bytes_atomic(out / "summary.md", summary_markdown(study, metric).encode())
    plot_history(study, metric, out / "history.png")
    complete = [t for t in counted(study) if t.state == TrialState.COMPLETE]
    if not complete:
        return None
    pick = max if study.direction.name == "MAXIMIZE" else min
    best = pick(complete, key=lambda t: t.value)
    cfg = dict(best.user_attrs["config"])
    cfg["run"] = {
        **cfg["run"],
        "output_dir": str(out / "best"),
        "name": f"{cfg['run']['name']}-best",
    }
    header = (
        f"# best trial {best.number} of study {study.study_name!r}: {metric}={best.value:.4f}\n"
    )
    path = out / "best_config.yaml"
    write_bytes_atomic(path, (header + yaml.safe_dump(cfg, sort_keys=False)).encode())
    return path


def plot_history(study: Any, metric: str, path: Path) -> None:
    from optuna.trial import TrialState

    from hpc_core.plots import figure, write_png

    fig = figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    done = [t for t in counted(study) if t.state == TrialState.COMPLETE]
    pruned = [t for t in counted(study) if t.state == TrialState.PRUNED]
    failed = [t.number for t in counted(study) if t.state == TrialState.FAIL]
    ax.scatter([t.number for t in done], [t.value for t in done], label="complete", zorder=3)
    pv = [
        (t.number, t.intermediate_values[max(t.intermediate_values)])
        for t in pruned
        if t.intermediate_values
    ]
    if pv:
        ax.scatter(*zip(*pv, strict=True), marker="x", color="grey", label="pruned (last report)")
    for i, n in enumerate(failed):
        ax.axvline(n, color="C3", alpha=0.3, label="failed" if i == 0 else None)
    if done:
        pick = max if study.direction.name == "MAXIMIZE" else min
        best, xs, ys = None, [], []
        for t in sorted(done, key=lambda t: t.number):
            best = t.value if best is None else pick(best, t.value)
            xs.append(t.number)
            ys.append(best)
        ax.step(xs, ys, where="post", color="C1", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(f"study {study.study_name}")
    ax.legend()
    write_png(fig, path)


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="base training config (YAML)")
    p.add_argument(
        "--space", required=True, help="search-space YAML (see configs/space_digits.yaml)"
    )
    p.add_argument(
        "--trials",
        type=int,
        required=True,
        help="complete or pruned trials the study should hold, all workers together; failed "
        "trials do not count (a new one replaces each)",
    )
    p.add_argument(
        "--storage",
        default=None,
        help="optuna storage URL shared by all workers: sqlite:///study.db or "
        "postgresql://user@host/db (default: sqlite:///OUT/study.db)",
    )
    p.add_argument("--study-name", default=None, help="default: study.name, else run.name")
    p.add_argument("--out", default=None, help="output folder (default: run.output_dir/tune)")
    p.add_argument(
        "--worker-index",
        type=int,
        default=None,
        help="offsets the sampler seed so workers propose different trials "
        "(default: $SLURM_ARRAY_TASK_ID, $JOB_COMPLETION_INDEX, else the process id)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the base config (repeatable)",
    )
    p.add_argument("--log-format", choices=["auto", "text", "json"], default="auto")


def _worker_index(arg: int | None) -> int:
    if arg is not None:
        return arg
    for var in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return os.getpid()


def run_tune(args: argparse.Namespace) -> int:
    setup_logging(args.log_format)
    try:
        base = load_config(args.config, args.overrides)
        space = load_space(args.space)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.trials < 1:
        print("--trials must be at least 1", file=sys.stderr)
        return 2
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = Path(args.out) if args.out else base.run.output_dir / "tune"
    out.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{out.resolve()}/study.db"
    result = run_worker(
        base,
        space,
        trials=args.trials,
        storage=storage,
        out=out,
        study_name=args.study_name,
        worker_index=_worker_index(args.worker_index),
    )
    metric = space.study.metric
    print(summary_markdown(result.study, metric), end="")
    if result.stopped == "failures":
        print(
            f"this worker stopped after {space.study.max_consecutive_failures} failed trials "
            "in a row: see each trial's error above",
            file=sys.stderr,
        )
    if not result.finished:
        # Reports written now would miss the running trials: the last worker writes them.
        print(f"trials still running in other workers: the last to finish writes {out}/"
              "summary.md", file=sys.stderr)  # fmt: skip
        return 1 if result.stopped == "failures" else 0
    best = write_reports(result.study, metric, out)
    if best is None:
        print("no trial completed", file=sys.stderr)
        return 1
    print(f"best config: {best}\nhistory: {out / 'history.png'}")
    return 1 if result.stopped == "failures" else 0
