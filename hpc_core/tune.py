"""Hyperparameter search with Optuna: ``hpc-train tune``.

Each ``hpc-train tune`` process is one worker. Workers on any number of machines share one
study through its storage (``sqlite:///study.db`` on one machine or a shared disk,
``postgresql://...`` for many), so a Slurm array or a Kubernetes Job of N pods is N workers.
``--trials`` is the study's total, not each worker's: a worker stops once the study holds that
many trials. Every trial is a real training run (``hpc_core.Trainer``) whose evaluations are
reported to the pruner through a trainer hook; a pruned trial checkpoints and stops at the next
step.

Outputs under ``--out``: ``trial_NNNN/`` (each trial's run), ``best_config.yaml`` (the best
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from hpc_core.atomic import write_bytes_atomic
from hpc_core.config import ConfigError, TrainConfig, config_from_dict, load_config
from hpc_core.logs import setup_logging
from hpc_core.search_space import SearchSpace, apply_params, load_space, suggest

log = logging.getLogger(__name__)


class PruningHook:
    """Reports each evaluation of ``metric`` to the trial; asks the trainer to stop if pruned."""

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.pruned_at: int | None = None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
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


def make_storage(url: str, *, attempts: int = STORAGE_ATTEMPTS) -> Any:
    """An Optuna RDB storage at ``url``; safe when many workers open a fresh one at once."""
    import optuna
    from sqlalchemy import exc

    # SQLite serialises writers: wait for the lock instead of failing when workers collide.
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    if url.startswith("postgresql://"):
        # SQLAlchemy 2.1 defaults to psycopg 3; the tracking extra ships psycopg2.
        url = "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    for attempt in range(1, attempts + 1):
        try:
            with _first_open_lock(url):
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
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


def _pruner(space: SearchSpace, max_steps: int) -> Any:
    import optuna

    s = space.study
    if s.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=s.n_startup_trials, n_warmup_steps=s.n_warmup_steps
        )
    if s.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_steps)
    return optuna.pruners.NopPruner()


def trial_config(base: TrainConfig, params: dict[str, Any], out: Path, number: int) -> TrainConfig:
    tree = apply_params(base.to_dict(), params)
    tree["run"]["output_dir"] = str(out / f"trial_{number:04d}")
    tree["run"]["name"] = f"{base.run.name}-trial{number}"
    tree["logging"]["progress"] = "off"
    return config_from_dict(tree, source=f"trial {number}")


def _objective(base: TrainConfig, space: SearchSpace, out: Path, worker: str) -> Any:
    import optuna

    from hpc_core.trainer import Trainer

    metric = space.study.metric

    def objective(trial: optuna.Trial) -> float:
        params = suggest(trial, space)
        cfg = trial_config(base, params, out, trial.number)
        trial.set_user_attr("worker", worker)
        trial.set_user_attr("config", cfg.to_dict())
        hook = PruningHook(trial, metric)
        t0 = time.perf_counter()
        result = Trainer(cfg, hooks=[hook]).train()
        trial.set_user_attr("seconds", round(time.perf_counter() - t0, 3))
        trial.set_user_attr("steps", result.final_step)
        if hook.pruned_at is not None:
            raise optuna.TrialPruned(f"pruned at step {hook.pruned_at}")
        if metric not in result.metrics:
            raise RuntimeError(f"the run reported no {metric!r}: set study.metric to an eval/* key")
        return result.metrics[metric]

    return objective


def run_worker(
    base: TrainConfig,
    space: SearchSpace,
    *,
    trials: int,
    storage: str,
    out: Path,
    study_name: str | None = None,
    worker_index: int = 0,
) -> Any:
    """Run trials until the study holds ``trials`` of them; return the study."""
    import optuna

    out.mkdir(parents=True, exist_ok=True)
    max_steps = base.training.max_steps or 10**6
    study = optuna.create_study(
        study_name=study_name or space.study.name or base.run.name,
        storage=make_storage(storage),
        direction=space.study.direction,
        sampler=_sampler(space, worker_index),
        pruner=_pruner(space, max_steps),
        load_if_exists=True,
    )
    worker = f"{socket.gethostname()}:{os.getpid()}"
    objective = _objective(base, space, out, worker)
    while len(study.get_trials(deepcopy=False)) < trials:
        trial = study.ask()
        if trial.number >= trials:
            # Another worker took the last slot between our count and our ask.
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            break
        try:
            value = objective(trial)
        except optuna.TrialPruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        except ConfigError as e:
            log.error("trial %d: sampled config is invalid: %s", trial.number, e)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, value)
    return study


def counted(study: Any, trials: int) -> list[Any]:
    """The study's first ``trials`` trials (a surplus ask from a race is not one of them)."""
    return [t for t in study.get_trials(deepcopy=False) if t.number < trials]


def summary_markdown(study: Any, trials: int, metric: str) -> str:
    lines = [
        f"| trial | state | {metric} | steps | seconds | worker | params |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in counted(study, trials):
        value = t.value
        if value is None and t.intermediate_values:
            value = t.intermediate_values[max(t.intermediate_values)]
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t.params.items())
        lines.append(
            f"| {t.number} | {t.state.name.lower()} | "
            f"{'' if value is None else f'{value:.4f}'} | {t.user_attrs.get('steps', '')} | "
            f"{t.user_attrs.get('seconds', '')} | {t.user_attrs.get('worker', '')} | {params} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_reports(study: Any, trials: int, metric: str, out: Path) -> Path | None:
    """best_config.yaml, summary.md and history.png; returns the best config's path."""
    from optuna.trial import TrialState

    write_bytes_atomic(out / "summary.md", summary_markdown(study, trials, metric).encode())
    plot_history(study, trials, metric, out / "history.png")
    complete = [t for t in counted(study, trials) if t.state == TrialState.COMPLETE]
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


def plot_history(study: Any, trials: int, metric: str, path: Path) -> None:
    from optuna.trial import TrialState

    from hpc_core.plots import figure, write_png

    fig = figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    done = [t for t in counted(study, trials) if t.state == TrialState.COMPLETE]
    pruned = [t for t in counted(study, trials) if t.state == TrialState.PRUNED]
    ax.scatter([t.number for t in done], [t.value for t in done], label="complete", zorder=3)
    pv = [
        (t.number, t.intermediate_values[max(t.intermediate_values)])
        for t in pruned
        if t.intermediate_values
    ]
    if pv:
        ax.scatter(*zip(*pv, strict=True), marker="x", color="grey", label="pruned (last report)")
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
        "--trials", type=int, required=True, help="total trials in the study (all workers)"
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
    study = run_worker(
        base,
        space,
        trials=args.trials,
        storage=storage,
        out=out,
        study_name=args.study_name,
        worker_index=_worker_index(args.worker_index),
    )
    best = write_reports(study, args.trials, space.study.metric, out)
    print(summary_markdown(study, args.trials, space.study.metric), end="")
    if best is None:
        print("no trial completed", file=sys.stderr)
        return 1
    print(f"best config: {best}\nhistory: {out / 'history.png'}")
    return 0
