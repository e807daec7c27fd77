"""hpc-train tune's two backends on the same search: Optuna (2 workers sharing a SQLite study)
against Ray Tune (a local Ray of 2 CPUs, one per trial), each a fresh `hpc-train tune` command.

The same space (configs/space_digits.yaml's kind: log-uniform LR, two widths; median pruning,
which the Ray backend runs as ASHA, neither before step 40: the config's learning rate warms
up over 20 steps, and at step 20 every trial scores at chance, 0.09-0.13 on digits, so a
pruner there stops trials at random), the same seed, the same trial budget on digits. For each:
the best validation accuracy, trials complete/pruned/failed, wall time, and the overhead per
trial: the two trial slots' time not spent inside a trial's own run (process and Ray start-up,
scheduling, checkpoint copies, reports), ``(2 x wall - sum of trial seconds) / trials``.

Each backend searches ``--seeds`` times (the space's seed 0, 1, ...: the sampler's draws, so
the trials a pruner lets finish); the targets are on the means. Targets: Ray's best within 0.5
point of Optuna's; Ray's overhead at most 2 s per trial.

    python benchmarks/tune_backends.py [--trials 16] [--trial-steps 120] [--seeds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import cpu_line, parse_args, verdict  # noqa: E402

CONFIG = REPO / "configs/digits.yaml"
SPACE = """\
study: {metric: eval/acc, pruner: median, n_startup_trials: 2, n_warmup_steps: 40, seed: SEED}
params:
  optimizer.lr: {type: float, low: 1.0e-4, high: 0.3, log: true}
  model.kwargs.width: {type: categorical, choices: [8, 16]}
"""


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_TMPDIR"] = str(root / "rt")  # the local Ray's sessions: not /tmp/ray
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # one core per trial in both backends
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # The local Ray's token, its own: nothing is written to ~/.ray.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    env.pop("RAY_ADDRESS", None)
    return env


def _tune(out: Path, space: Path, trials: int, steps: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "hpc_core.cli", "tune", "--config", str(CONFIG)]
    cmd += ["--space", str(space), "--trials", str(trials), "--out", str(out)]
    for s in ("training.epochs=null", f"training.max_steps={steps}",
              "training.eval_every_steps=10", "checkpoint.best_metric=null"):  # fmt: skip
        cmd += ["--set", s]
    return cmd + extra


def _read(out: Path, wall: float, trials: int) -> dict[str, float]:
    summary = (out / "summary.md").read_text()
    tally = re.match(r"(\d+) complete, (\d+) pruned, (\d+) fail", summary)
    assert tally, summary
    seconds = [
        float(cells[5])
        for line in summary.splitlines()
        if re.match(r"\| \d+ \|", line)
        and (cells := [c.strip() for c in line.split("|")])[5]
    ]
    header = (out / "best_config.yaml").read_text().splitlines()[0]
    best = float(header.rsplit("=", 1)[1])
    return {
        "best": best,
        "complete": int(tally[1]),
        "pruned": int(tally[2]),
        "failed": int(tally[3]),
        "wall": wall,
        "trial_s": sum(seconds),
        "overhead": (2 * wall - sum(seconds)) / trials,
    }


def optuna_two_workers(root: Path, space: Path, trials: int, steps: int) -> dict[str, float]:
    out = root / "optuna"
    storage = f"sqlite:///{root}/study.db"
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            _tune(out, space, trials, steps, ["--storage", storage, "--worker-index", str(i)]),
            env=_env(root),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
    return _read(out, time.perf_counter() - t0, trials)


def ray_local(root: Path, space: Path, trials: int, steps: int) -> dict[str, float]:
    out = root / "ray"
    t0 = time.perf_counter()
    cmd = _tune(out, space, trials, steps, ["--backend", "ray", "--cpus-per-trial", "1"])
    done = subprocess.run(cmd, env=_env(root), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return _read(out, time.perf_counter() - t0, trials)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    ap.add_argument("--trials", type=int, default=16, help="trial budget of each backend")
    ap.add_argument("--trial-steps", type=int, default=120, help="optimizer steps per trial")
    ap.add_argument("--seeds", type=int, default=3,
                    help="searches of each backend, the space's seed 0, 1, ... (which trials "
                         "a pruner lets finish moves a search's best by a point)")
    args = parse_args(ap, quick={"trials": 3, "trial_steps": 20, "seeds": 1})
    if os.cpu_count() != 2:
        print(f"note: this host has {os.cpu_count()} CPUs; the local Ray takes all of them")
    print(f"host: {cpu_line()}")
    print(f"command: python benchmarks/tune_backends.py --trials {args.trials} "
          f"--trial-steps {args.trial_steps} --seeds {args.seeds}"
          f"{' --quick' if args.quick else ''}\n")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"optuna, 2 workers": [], "ray, local 2 CPUs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            root = Path(tmp) / f"seed{seed}"
            root.mkdir()
            space = root / "space.yaml"
            space.write_text(SPACE.replace("SEED", str(seed)))
            runs["optuna, 2 workers"].append(
                optuna_two_workers(root / "o", space, args.trials, args.trial_steps))
            runs["ray, local 2 CPUs"].append(
                ray_local(root / "r", space, args.trials, args.trial_steps))
    print("| backend | seed | best eval/acc | complete | pruned | failed | wall s "
          "| trial s (sum) | overhead s/trial |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        for seed, r in enumerate(rs):
            print(f"| {name} | {seed} | {r['best']:.4f} | {r['complete']:.0f} | "
                  f"{r['pruned']:.0f} | {r['failed']:.0f} | {r['wall']:.1f} | "
                  f"{r['trial_s']:.1f} | {r['overhead']:.2f} |")  # fmt: skip
    mean = {name: {k: sum(r[k] for r in rs) / len(rs) for k in ("best", "overhead")}
            for name, rs in runs.items()}
    opt, ray = mean["optuna, 2 workers"], mean["ray, local 2 CPUs"]
    print(f"\nmeans over {args.seeds} seeds: optuna best {opt['best']:.4f}, overhead "
          f"{opt['overhead']:.2f} s/trial; ray best {ray['best']:.4f}, overhead "
          f"{ray['overhead']:.2f} s/trial")
    gap = 100 * (ray["best"] - opt["best"])
    verdict(f"ray best minus optuna best eval/acc (mean of {args.seeds} seeds)", gap, ">=",
            -0.5, "pt",
            also=[("ray overhead per trial <= 2 s", ray["overhead"] <= 2.0)],
            note=f"ray overhead {ray['overhead']:.2f} s/trial, optuna "
                 f"{opt['overhead']:.2f} s/trial")  # fmt: skip


if __name__ == "__main__":
    main()
