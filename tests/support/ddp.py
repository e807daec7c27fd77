"""The training run the DDP equivalence tests compare: 2 ranks (one node or two) against one
process, same global batch. No dropout (per-rank masks would differ from one process's) and
no BatchNorm (per-rank batch statistics differ): then DDP must match one process to float
rounding."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SETS = [
    "training.device=cpu",  # gloo on CPU ranks, also on a host with one GPU
    "model.name=small_cnn",
    "model.kwargs={width: 8, norm: none, dropout: 0.0}",
    "training.global_batch_size=64",
    "training.max_steps=5",
    "training.eval_every_steps=5",
    "logging.progress=off",
    "checkpoint.best_metric=null",
]


def train_argv(launcher: list[str], out: Path, extra: list[str] | None = None) -> list[str]:
    """``launcher -m hpc_core.train`` on configs/digits.yaml with SETS, writing to ``out``."""
    cmd = [*launcher, "-m", "hpc_core.train", "--config", str(REPO / "configs/digits.yaml")]
    for s in [*SETS, f"run.output_dir={out}", *(extra or [])]:
        cmd += ["--set", s]
    return cmd
