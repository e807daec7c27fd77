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

``--backend ray`` runs the same study on a Ray cluster through Ray Tune (``OptunaSearch`` and
ASHA, the same trials, failure rules and outputs): :mod:`hpc_core.tune.ray_backend`.

This module is the command (its flags and ``run_tune``); the parts live beside it in
:mod:`hpc_core.tune`: ``worker`` (joining the study, the trial loop), ``trial`` (one trial, its
pruning hook and heartbeat), ``storage`` (the shared storage, opened safely by many workers at
once), ``report`` (the summary table, best config and history plot) and ``search_space`` (the
space file).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpc_core.config import ConfigError, load_config
from hpc_core.logs import setup_logging
from hpc_core.tune.report import summary_markdown, write_reports
from hpc_core.tune.search_space import load_space
from hpc_core.tune.study_run import close_study_run
from hpc_core.tune.worker import run_worker

# Not imported: hpc_core.trainer (torch) until a worker runs; optuna until a command needs it.


RAY_INSTALL_HINT = "--backend ray needs Ray Tune: pip install 'edgetrain[ray]'"


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
    p.add_argument(
        "--backend",
        choices=["optuna", "ray"],
        default="optuna",
        help="optuna: this process is one worker of a study in --storage; ray: one driver "
        "placing the trials on a Ray cluster (Ray Tune: OptunaSearch + ASHA), its experiment "
        "in OUT/ray, restored when the command runs again",
    )
    p.add_argument(
        "--address",
        default=None,
        help="ray: the cluster to use: auto (the one started on this machine with `ray start`),"
        " HOST:PORT (its GCS) or ray://HOST:10001 (Ray Client); default: start a Ray on this "
        "machine for the search",
    )
    p.add_argument(
        "--cpus-per-trial", type=float, default=1.0, help="ray: CPUs each trial holds (default 1)"
    )
    p.add_argument(
        "--gpus-per-trial",
        type=float,
        default=0.0,
        help="ray: GPUs each trial holds, fractional allowed (0.5: two trials share a GPU)",
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
    if args.backend == "ray":
        try:
            from hpc_core.tune.ray_backend import run_ray
        except ImportError as e:
            if (e.name or "").split(".")[0] != "ray":
                raise
            print(RAY_INSTALL_HINT, file=sys.stderr)
            return 2
        return run_ray(args, base, space, out)
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
    if result.parent is not None:
        status = {"done": "FINISHED", "failures": "FAILED", "signal": "KILLED"}[result.stopped]
        close_study_run(result.parent, result.study, metric, status=status)
    if best is None:
        print("no trial completed", file=sys.stderr)
        return 1
    print(f"best config: {best}\nhistory: {out / 'history.png'}")
    return 1 if result.stopped == "failures" else 0
