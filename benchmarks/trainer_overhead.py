"""What does hpc_core.Trainer cost over a hand-written PyTorch loop?

Runs the same model, data order, batch and seed through (a) a plain loop written below and
(b) ``hpc_core.Trainer`` with logging, evaluation and checkpointing at their defaults, each in
its own process (so peak RSS is its own), alternating a/b for ``--rounds`` rounds. Prints the
median step-time ratio b/a, the peak-RSS ratio and whether the final fp32 weights are bitwise
equal. Targets: <= 1.03, <= 1.05, equal.

    python benchmarks/trainer_overhead.py [--epochs 6] [--rounds 3] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_core.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # first: this checkout, not another install of the packages

from benchmarks.harness import parse_args, verdict  # noqa: E402

SETS = [
    "model.name=small_cnn",
    "model.kwargs={width: 32, norm: batch, dropout: 0.1}",
    "optimizer.name=adamw",
    "optimizer.lr=0.002",
    "schedule.warmup_steps=0",
    "schedule.decay=constant",  # the plain loop below keeps a constant LR too
    "training.global_batch_size=64",
    "training.grad_clip_norm=1.0",
    "logging.progress=off",
]


def plain_loop(cfg: TrainConfig, out: Path) -> list[float]:
    """The loop a PyTorch user writes by hand, sharing only the data set and model builders."""
    import random

    import numpy as np
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader, DistributedSampler

    from hpc_core.data import build_datasets
    from hpc_core.models import build_model

    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    train, _, info = build_datasets(cfg.data)
    model = build_model(
        cfg.model.name,
        num_classes=info.num_classes,
        in_channels=info.in_channels,
        image_size=info.image_size,
        **cfg.model.kwargs,
    )
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optimizer.lr,
        betas=cfg.optimizer.betas,
        eps=cfg.optimizer.eps,
        weight_decay=cfg.optimizer.weight_decay,
    )
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=cfg.run.seed)
    loader = DataLoader(
        train,
        batch_size=cfg.training.global_batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(cfg.run.seed),
    )
    steps_per_epoch = len(train) // cfg.training.global_batch_size
    times = [time.perf_counter()]
    model.train()
    for epoch in range(cfg.training.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i == steps_per_epoch:
                break
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter())
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "weights.safetensors")
    )
    return [b - a for a, b in itertools.pairwise(times)]


def trainer_loop(cfg: TrainConfig, out: Path) -> list[float]:
    from safetensors.torch import save_file

    from hpc_core.trainer import Trainer

    times = [time.perf_counter()]

    class StepClock:
        def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
            times.append(time.perf_counter())

    t = Trainer(cfg, hooks=[StepClock()])
    t.train()
    save_file(
        {k: v.contiguous() for k, v in t.raw_model.state_dict().items()},
        str(out / "weights.safetensors"),
    )
    return [b - a for a, b in itertools.pairwise(times)]


def child(kind: str, out: Path, epochs: int, threads: int) -> None:
    import resource

    import torch

    from hpc_core.config import load_config

    torch.set_num_threads(threads)
    cfg = load_config(
        REPO / "configs/digits.yaml",
        [*SETS, f"training.epochs={epochs}", f"run.output_dir={out / 'run'}"],
    )
    steps = (plain_loop if kind == "plain" else trainer_loop)(cfg, out)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / "result.json").write_text(json.dumps({"step_s": steps, "peak_rss_mb": rss_mb}))


def run_child(kind: str, out: Path, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--out",
            str(out),
            "--epochs",
            str(args.epochs),
            "--threads",
            str(args.threads),
        ],
        check=True,
        env=env,
    )
    return json.loads((out / "result.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3, help="a/b pairs, alternated to spread drift")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--child", choices=["plain", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parse_args(p, {"epochs": 1, "rounds": 1})
    if args.child:
        child(args.child, args.out, args.epochs, args.threads)
        return

    from safetensors.torch import load_file

    runs: dict[str, list[dict]] = {"plain": [], "trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in ("plain", "trainer"):
                runs[kind].append(run_child(kind, Path(tmp) / f"{kind}{r}", args))
        a = load_file(str(Path(tmp) / "plain0/weights.safetensors"))
        b = load_file(str(Path(tmp) / "trainer0/weights.safetensors"))
        bitwise = a.keys() == b.keys() and all((a[k] == b[k]).all().item() for k in a)

    # Each round's first step pays one-off warm-up; the median is robust to it and to evals.
    med = {k: statistics.median(s for run in v for s in run["step_s"][1:]) for k, v in runs.items()}
    rss = {k: max(run["peak_rss_mb"] for run in v) for k, v in runs.items()}
    steps = len(runs["plain"][0]["step_s"])
    print(
        f"small_cnn(width 32) on digits 16x16, batch 64, {steps} steps x {args.rounds} rounds, "
        f"{args.threads} thread(s)"
    )
    print(f"{'':28}{'plain loop':>12}{'Trainer':>12}{'ratio':>9}{'target':>9}")
    print(
        f"{'median step time (ms)':28}{med['plain'] * 1e3:12.3f}{med['trainer'] * 1e3:12.3f}"
        f"{med['trainer'] / med['plain']:9.3f}{'<= 1.03':>9}"
    )
    print(
        f"{'peak RSS (MB)':28}{rss['plain']:12.1f}{rss['trainer']:12.1f}"
        f"{rss['trainer'] / rss['plain']:9.3f}{'<= 1.05':>9}"
    )
    print(f"{'final fp32 weights':28}{'':24}{'bitwise equal' if bitwise else 'DIFFERENT':>18}")
    verdict("Trainer / plain loop median step time ratio", med["trainer"] / med["plain"], "<=",
            1.03, also=[("peak RSS ratio <= 1.05", rss["trainer"] / rss["plain"] <= 1.05),
                        ("final weights bitwise equal", bitwise)])


if __name__ == "__main__":
    main()
