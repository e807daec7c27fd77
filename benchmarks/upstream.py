"""Upstream tooling on digits: pruning's saving, the LR finder's cost, the estimate's accuracy.

1. The same 6-trial Optuna study (TPE, same seed) with the median pruner and without pruning:
   wall time of each and the saving (target: pruning saves >= 30%), plus each study's best
   value (pruning must not cost the best trial).
2. The LR finder on configs/digits.yaml: wall time, steps and its suggestion.
3. ``hpc-train estimate`` for a 2-epoch digits run against the measured run on this machine:
   predicted / measured training time (start-up excluded from both).
4. ``hpc-train batch-find --limit-mb 700`` on configs/digits.yaml: the batch it reports, its
   probes and wall time; then, at that batch, repeated fresh probes and repeated 3-epoch
   trainings in fresh processes (peak RSS of each: the claim is that every training stays
   under the limit), and the same trainings with glibc's mmap threshold pinned, which shows
   where the run-to-run spread that the headroom covers comes from.

    python benchmarks/upstream.py [--threads 1] [--trial-steps 120] [--only batch-find] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hpc_core.batch_find import find_batch_size, probe
from hpc_core.config import load_config
from hpc_core.estimate import DEFAULT_PRICES, estimate, load_prices
from hpc_core.lr_find import lr_range_test
from hpc_core.trainer import Trainer
from hpc_core.tune.report import counted
from hpc_core.tune.search_space import SearchSpace
from hpc_core.tune.worker import run_worker

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import parse_args, verdict  # noqa: E402

CONFIG = REPO / "configs/digits.yaml"


def study(pruner: str, steps: int, out: Path, n_trials: int = 6) -> tuple[float, float, int]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = load_config(
        CONFIG,
        [
            "training.epochs=null",
            f"training.max_steps={steps}",
            "training.eval_every_steps=10",
            "checkpoint.best_metric=null",
            "logging.progress=off",
        ],
    )
    space = SearchSpace.model_validate(
        {
            "study": {"metric": "eval/acc", "pruner": pruner, "n_startup_trials": 2, "seed": 0},
            "params": {
                "optimizer.lr": {"type": "float", "low": 1e-5, "high": 1.0, "log": True},
                "model.kwargs.width": {"type": "categorical", "choices": [8, 16]},
            },
        }
    )
    t0 = time.perf_counter()
    s = run_worker(base, space, trials=n_trials, storage=f"sqlite:///{out}/study.db", out=out).study
    wall = time.perf_counter() - t0
    trials = counted(s)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    return wall, s.best_value, pruned


_TRAIN_AND_REPORT_PEAK = """
import sys
from hpc_core.config import load_config
from hpc_core.metrics import peak_rss_mb
from hpc_core.trainer import Trainer

Trainer(load_config(sys.argv[1], sys.argv[2:])).train()
print(peak_rss_mb())
"""


def train_peak_mb(batch: int, out: Path, env: dict[str, str], epochs: int = 3) -> float:
    """Peak RSS of a fresh process training ``epochs`` at ``batch`` (as `hpc-train train`)."""
    sets = [f"training.global_batch_size={batch}", f"training.epochs={epochs}",
            "logging.progress=off"]
    run = subprocess.run(
        [sys.executable, "-c", _TRAIN_AND_REPORT_PEAK, str(CONFIG), *sets, f"run.output_dir={out}"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(run.stdout)


def batch_find_truth(root: Path, limit_mb: float, threads: int, repeats: int = 3,
                     epochs: int = 3, start: int = 1, max_batch: int = 65536) -> float:
    """The highest training peak at the batch found, over ``limit_mb``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cfg = load_config(CONFIG, [f"run.output_dir={root / 'bf'}", "logging.progress=off"])
    t0 = time.perf_counter()
    r = find_batch_size(cfg, limit_mb=limit_mb, multiple_of=8, start=start,
                        max_batch=max_batch)
    wall = time.perf_counter() - t0
    b = r.batch_size
    print(f"## batch-find --limit-mb {limit_mb:.0f} --multiple-of 8 (headroom 10 %: probes may "
          f"peak at {r.probe_limit_mb} MB)")  # fmt: skip
    print(f"batch {b} ({r.limited_by}) after {len(r.probes)} probes, {wall:.0f} s")
    probes = [probe(cfg, b, None).peak_mb for _ in range(repeats)]
    trains = [train_peak_mb(b, root / f"t{i}", env, epochs) for i in range(repeats)]
    pinned_env = {**env, "MALLOC_MMAP_THRESHOLD_": "131072"}
    pinned = [train_peak_mb(b, root / f"p{i}", pinned_env, epochs) for i in range(repeats)]
    print(f"| at batch {b}, {repeats} fresh processes each | peak RSS MB |")
    print("|---|---|")
    print(f"| probe | {', '.join(f'{v:.1f}' for v in probes if v is not None)} |")
    print(f"| {epochs}-epoch training | {', '.join(f'{v:.1f}' for v in trains)} |")
    print(f"| {epochs}-epoch training, MALLOC_MMAP_THRESHOLD_=131072 | "
          f"{', '.join(f'{v:.1f}' for v in pinned)} |")  # fmt: skip
    verdict = "within" if max(trains) <= limit_mb else "OVER"
    print(f"every training {verdict} the {limit_mb:.0f} MB limit (max {max(trains):.1f} MB)\n")
    return max(trains) / limit_mb


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trial-steps", type=int, default=120)
    p.add_argument("--only", choices=["batch-find"], default=None)
    p.add_argument("--limit-mb", type=float, default=700.0, help="batch-find's limit")
    p.add_argument("--trials", type=int, default=6, help="trials per study")
    p.add_argument("--lr-steps", type=int, default=100, help="the LR finder's steps")
    p.add_argument("--estimate-epochs", type=int, default=2, help="the estimated run's epochs")
    p.add_argument("--repeats", type=int, default=3,
                   help="batch-find: fresh probes and trainings at the batch found")
    p.add_argument("--train-epochs", type=int, default=3,
                   help="batch-find: epochs of each training at the batch found")
    p.add_argument("--batch-start", type=int, default=1, help="batch-find's first probe")
    p.add_argument("--max-batch", type=int, default=65536, help="batch-find's largest batch")
    args = parse_args(p, {"trial_steps": 6, "trials": 3, "lr_steps": 10, "estimate_epochs": 1,
                          "repeats": 1, "train_epochs": 1, "batch_start": 16,
                          "max_batch": 16})
    bf = {"repeats": args.repeats, "epochs": args.train_epochs, "start": args.batch_start,
          "max_batch": args.max_batch}
    torch.set_num_threads(args.threads)
    import logging

    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.only == "batch-find":
            peak = batch_find_truth(root, args.limit_mb, args.threads, **bf)
            verdict("batch-find: highest training peak at its batch / limit ratio", peak, "<=",
                    1.0)
            return
        print(f"## {args.trials}-trial study, {args.trial_steps} steps per trial, "
              f"{args.threads} thread(s)")
        print("| pruner | wall s | pruned trials | best eval/acc |")
        print("|---|---|---|---|")
        rows = {}
        for pruner in ("none", "median"):
            wall, best, pruned = study(pruner, args.trial_steps, root / pruner, args.trials)
            rows[pruner] = wall
            print(f"| {pruner} | {wall:.1f} | {pruned} | {best:.4f} |")
        saving = 1 - rows["median"] / rows["none"]
        print(f"pruning saves {saving:.0%} of the study's wall time (target >= 30%)\n")

        cfg = load_config(CONFIG, [f"run.output_dir={root / 'lr'}", "logging.progress=off"])
        r = lr_range_test(cfg, steps=args.lr_steps)
        print(f"## LR finder: {r.seconds:.1f} s for {len(r.losses)} steps ({r.stopped}), "
              f"suggestion {r.suggestion:.3g}\n")  # fmt: skip

        cfg = load_config(
            CONFIG,
            [f"training.epochs={args.estimate_epochs}", f"run.output_dir={root / 'est'}",
             "logging.progress=off"],
        )
        e = estimate(cfg, "a100", load_prices(DEFAULT_PRICES))
        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        trainer.train()
        measured = time.perf_counter() - t0
        print(f"## estimate vs measured, {args.estimate_epochs}-epoch digits run on this "
              "machine")
        print(f"predicted {e.total_s:.2f} s, measured {measured:.2f} s, "
              f"ratio predicted/measured = {e.total_s / measured:.2f}\n")  # fmt: skip

        peak = batch_find_truth(root, args.limit_mb, args.threads, **bf)
    verdict("median-pruned / unpruned study wall time ratio", 1 - saving, "<=", 0.7,
            note=f"pruning saves {saving:.0%}",
            also=[("every batch-find training within its limit", peak <= 1.0)])


if __name__ == "__main__":
    main()
