"""Upstream tooling on digits: pruning's saving, the LR finder's cost, the estimate's accuracy.

1. The same 6-trial Optuna study (TPE, same seed) with the median pruner and without pruning:
   wall time of each and the saving (target: pruning saves >= 30%), plus each study's best
   value (pruning must not cost the best trial).
2. The LR finder on configs/digits.yaml: wall time, steps and its suggestion.
3. ``hpc-train estimate`` for a 2-epoch digits run against the measured run on this machine:
   predicted / measured training time (start-up excluded from both).

    python benchmarks/upstream.py [--threads 1] [--trial-steps 120]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from hpc_core.config import load_config
from hpc_core.estimate import DEFAULT_PRICES, estimate, load_prices
from hpc_core.lr_find import lr_range_test
from hpc_core.search_space import SearchSpace
from hpc_core.trainer import Trainer
from hpc_core.tune import counted, run_worker

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/digits.yaml"


def study(pruner: str, steps: int, out: Path) -> tuple[float, float, int]:
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
    s = run_worker(base, space, trials=6, storage=f"sqlite:///{out}/study.db", out=out)
    wall = time.perf_counter() - t0
    trials = counted(s, 6)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    return wall, s.best_value, pruned


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trial-steps", type=int, default=120)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import logging

    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"## 6-trial study, {args.trial_steps} steps per trial, {args.threads} thread(s)")
        print("| pruner | wall s | pruned trials | best eval/acc |")
        print("|---|---|---|---|")
        rows = {}
        for pruner in ("none", "median"):
            wall, best, pruned = study(pruner, args.trial_steps, root / pruner)
            rows[pruner] = wall
            print(f"| {pruner} | {wall:.1f} | {pruned} | {best:.4f} |")
        saving = 1 - rows["median"] / rows["none"]
        print(f"pruning saves {saving:.0%} of the study's wall time (target >= 30%)\n")

        cfg = load_config(CONFIG, [f"run.output_dir={root / 'lr'}", "logging.progress=off"])
        r = lr_range_test(cfg)
        print(f"## LR finder: {r.seconds:.1f} s for {len(r.losses)} steps ({r.stopped}), "
              f"suggestion {r.suggestion:.3g}\n")  # fmt: skip

        cfg = load_config(
            CONFIG,
            ["training.epochs=2", f"run.output_dir={root / 'est'}", "logging.progress=off"],
        )
        e = estimate(cfg, "a100", load_prices(DEFAULT_PRICES))
        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        trainer.train()
        measured = time.perf_counter() - t0
        print("## estimate vs measured, 2-epoch digits run on this machine")
        print(f"predicted {e.total_s:.2f} s, measured {measured:.2f} s, "
              f"ratio predicted/measured = {e.total_s / measured:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
