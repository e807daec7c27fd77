"""Batch-size finder: the largest per-process batch a training run fits in memory.

``hpc-train batch-find`` doubles the batch from ``start`` until a probe does not fit, then
bisects between the last fit and the first miss. The batch is capped at the training set's
size (a larger one cannot make a single step); the result says when the cap, not memory,
decided it.

A probe is a short training at that batch through the trainer's own loop: four optimizer steps
(forward, backward, clipping, optimizer update: from the second on, the optimizer's state, the
gradients and the activations are held at once), an evaluation pass over the validation split
at the same batch and a checkpoint after every second step, and the run's final evaluation and
checkpoint. Each probe runs in a fresh Python process, the way ``hpc-train train`` would: a
process that has already run a larger probe keeps memory in its allocator, and its reset
high-water mark then starts high (probes after a large failed one read 55-100 MB more). A probe
does not fit when it runs out of memory (an out-of-memory error, real or injected with
``HPC_FAULT_OOM_*``, or the process killed by the kernel) or its peak exceeds ``limit_mb`` less
``headroom_pct``:

- CUDA: ``torch.cuda.max_memory_allocated`` of the probe process;
- CPU: the probe process's resident-set high-water mark (VmHWM), interpreter, libraries and
  data included: what ``hpc-train train`` at that batch peaks at.

The headroom is there because on CPU the same run does not peak at the same RSS twice: glibc's
malloc moves its mmap threshold as large blocks are freed, and how much of the heap stays
fragmented differs from process to process. On digits (small_cnn, 16x16) at batch 720, the
answer for a 700 MB limit, three probes read 597-608 MB and three 3-epoch trainings 619-653 MB;
with the threshold pinned (MALLOC_MMAP_THRESHOLD_=131072) the trainings read 535.2-535.5 MB
(``benchmarks/upstream.py --only batch-find``). 10 % of the limit covers that spread; CUDA's
allocated bytes do not vary, so ``--headroom-pct 0`` suits a GPU.

Not probed: the tracking sinks (MLflow, W&B, TensorBoard) are off in probes; their client
libraries add their own memory to a training run that enables them.

The probe's two halves live here: the parent (``probe``) sends a ``ProbeRequest`` on the
child's stdin; the child (``python -m hpc_core.batch_find --probe``) answers with a ``Probe``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from hpc_core.config import ConfigError, TrainConfig, config_from_dict, load_config
from registry.lifetime import skip_startup_and_exit_collections

# Not imported here: torch and the trainer. The parent only starts probes; each child imports
# them itself, so the parent's own memory never enters a measurement.

DEFAULT_HEADROOM_PCT = 10.0
PROBE_STEPS = 4
"""Optimizer steps a probe trains, with an evaluation and a checkpoint after every second: a
step after those starts from a heap they left fragmented, and may peak higher."""
PROBE_TIMEOUT_S = 600
"""A probe that takes longer is stuck (swapping, most likely) and counts as not fitting."""


class ProbeRequest(BaseModel):
    """What the parent asks a probe process to run."""

    config: dict[str, Any]
    """The training config (``TrainConfig.to_dict()``); the probe sets the batch in it."""
    batch: int


class Probe(BaseModel):
    batch: int
    fits: bool
    peak_mb: float | None
    """None when the probe ran out of memory before finishing."""
    peak_phase: str | None = None
    """Where the peak was reached: first step, second step, evaluation or checkpoint save."""
    error: str | None = None
    """Why it did not finish: the out-of-memory error, or the signal that killed it."""


class BatchFindResult(BaseModel):
    batch_size: int
    limited_by: Literal["memory", "training set", "max batch"]
    """What decided the answer: a probe that did not fit, or a cap that no probe passed."""
    train_samples: int
    """Size of the training split: no batch is larger."""
    limit_mb: float | None
    probe_limit_mb: float | None
    """What a probe may peak at: limit_mb less the headroom."""
    measure: str
    """cuda_max_allocated | cpu_peak_rss"""
    probes: list[Probe]


# ---------------------------------------------------------------------------------------------
# The child: one probe, in a fresh process


def probe_config(cfg: TrainConfig, batch: int, output_dir: Path) -> TrainConfig:
    """The config a probe trains with: ``PROBE_STEPS`` steps of ``batch`` samples (and the
    same per evaluation batch), evaluating and checkpointing every second step, no
    accumulation, no OOM back-off, no tracking sinks, output in a scratch folder. The final
    and best checkpoints stay as the run has them: they are saved in a training too."""
    tree = cfg.to_dict()
    tree["run"]["output_dir"] = str(output_dir)
    tree["training"].update(
        global_batch_size=batch, micro_batch_size=None, max_steps=PROBE_STEPS, eval_every_steps=2
    )
    tree["training"]["early_stopping"]["patience"] = None
    tree["checkpoint"]["every_steps"] = 2
    tree["logging"].update(progress="off", tensorboard=False, mlflow=False, wandb=None)
    # The trainer halves the micro-batch on OOM down to this: here an OOM must fail the probe.
    tree["faults"].update(min_micro_batch_size=batch, handle_signals=False)
    return config_from_dict(tree, source=f"batch-find probe at {batch}")


class _PeakRecorder:
    """A trainer hook: the peak so far after each step (and its evaluation and save)."""

    def __init__(self, peak: Callable[[], float]) -> None:
        self.peak = peak
        self.peaks: list[tuple[str, float]] = []

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        done = "evaluation and checkpoint" if "eval/loss" in metrics else ""
        self.peaks.append((f"step {step}" + (f", {done}" if done else ""), self.peak()))


def run_probe(request: ProbeRequest) -> Probe:
    """Run the probe in this process (the child's half); the peak is this process's."""
    import torch

    from hpc_core.faults import is_oom
    from hpc_core.metrics import peak_rss_mb
    from hpc_core.trainer import Trainer

    def peak() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated() / 2**20
        return peak_rss_mb()

    recorder = _PeakRecorder(peak)
    with tempfile.TemporaryDirectory(prefix="batch-find-") as scratch:
        cfg = probe_config(config_from_dict(request.config), request.batch, Path(scratch))
        # The trainer's own loop, not single steps: the data loader's batches, the snapshot
        # taken before the first checkpoint and the final save are part of a run's peak.
        try:
            Trainer(cfg, hooks=[recorder]).train()
        except Exception as e:
            if not is_oom(e):
                raise
            return Probe(batch=request.batch, fits=False, peak_mb=None, error=str(e)[:300])
    recorder.peaks.append(("end of run (final evaluation and checkpoint)", peak()))
    top = max(p for _, p in recorder.peaks)
    # The high-water mark only grows: the peak was reached in the first phase that shows it.
    phase = next(name for name, p in recorder.peaks if p == top)
    return Probe(batch=request.batch, fits=True, peak_mb=round(top, 1), peak_phase=phase)


def _child_main() -> int:
    skip_startup_and_exit_collections()
    request = ProbeRequest.model_validate_json(sys.stdin.read())
    print(run_probe(request).model_dump_json())
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: the search


def probe(cfg: TrainConfig, batch: int, limit_mb: float | None) -> Probe:
    """Probe ``batch`` in a fresh process and judge it against ``limit_mb``."""
    # The child imports hpc_core from where this process did, installed or not.
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    request = ProbeRequest(config=cfg.to_dict(), batch=batch)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hpc_core.batch_find", "--probe"],
            input=request.model_dump_json(),
            capture_output=True,
            text=True,
            env=env,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return Probe(batch=batch, fits=False, peak_mb=None, error=f"over {PROBE_TIMEOUT_S} s")
    if proc.returncode < 0:
        # SIGKILL from the kernel's OOM killer is how a CPU process usually runs out of memory.
        name = signal.Signals(-proc.returncode).name
        return Probe(batch=batch, fits=False, peak_mb=None, error=f"probe killed by {name}")
    if proc.returncode != 0:
        raise RuntimeError(f"the probe at batch {batch} failed:\n{proc.stderr[-3000:]}")
    result = Probe.model_validate_json(proc.stdout.strip().splitlines()[-1])
    if result.peak_mb is not None and limit_mb is not None and result.peak_mb > limit_mb:
        result.fits = False
    return result


def train_samples(cfg: TrainConfig) -> int:
    from hpc_core.data import build_datasets

    return build_datasets(cfg.data)[2].num_train


def find_batch_size(
    cfg: TrainConfig,
    *,
    limit_mb: float | None = None,
    headroom_pct: float = DEFAULT_HEADROOM_PCT,
    start: int = 1,
    max_batch: int = 65536,
    multiple_of: int = 1,
) -> BatchFindResult:
    """Largest ``start`` x 2^k that fits, then bisection up to the first size that does not,
    in steps of ``multiple_of``; never above the training set's size or ``max_batch``."""
    probe_limit = None if limit_mb is None else limit_mb * (1 - headroom_pct / 100)
    n_train = train_samples(cfg)
    cap = min(max_batch, n_train)
    if cap >= multiple_of:
        cap -= cap % multiple_of
    start = min(start, cap)
    probes: list[Probe] = []

    def fits(b: int) -> bool:
        p = probe(cfg, b, probe_limit)
        probes.append(p)
        return p.fits

    if not fits(start):
        raise RuntimeError(
            f"batch {start} does not fit ({probes[-1]}): lower start, the model or the "
            "input size, or raise the limit"
        )
    lo, hi = start, None
    while hi is None and lo < cap:
        nxt = min(lo * 2, cap)
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi is not None and hi - lo > multiple_of:
        mid = (lo + hi) // 2
        mid -= mid % multiple_of
        if mid <= lo:  # a start that is no multiple: no multiple left between lo and hi
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    limited_by: Literal["memory", "training set", "max batch"] = "memory"
    if hi is None:
        limited_by = "training set" if n_train <= max_batch else "max batch"
    return BatchFindResult(
        batch_size=lo,
        limited_by=limited_by,
        train_samples=n_train,
        limit_mb=limit_mb,
        probe_limit_mb=None if probe_limit is None else round(probe_limit, 1),
        measure="cuda_max_allocated" if _uses_cuda(cfg) else "cpu_peak_rss",
        probes=probes,
    )


def _uses_cuda(cfg: TrainConfig) -> bool:
    import torch

    return cfg.training.device == "cuda" or (
        cfg.training.device == "auto" and torch.cuda.is_available()
    )


def add_batch_find_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--limit-mb",
        type=float,
        default=None,
        help="memory a training process may use: CUDA allocated bytes, or on CPU the "
        "process's peak RSS (default: no limit beyond running out of memory)",
    )
    p.add_argument(
        "--headroom-pct",
        type=float,
        default=DEFAULT_HEADROOM_PCT,
        help="a probe fits when it peaks at most this share below --limit-mb: the same run's "
        "peak varies from run to run (default: %(default)s)",
    )
    p.add_argument("--start", type=int, default=1, help="first batch probed")
    p.add_argument(
        "--multiple-of",
        type=int,
        default=1,
        help="bisect in steps of this (8 suits tensor cores; fewer probes)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=65536,
        help="never probe above this (nor above the training set's size)",
    )


def run_batch_find(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if min(args.start, args.max_batch, args.multiple_of) < 1 or not 0 <= args.headroom_pct < 100:
        print(
            "batch-find: --start, --max-batch and --multiple-of must be >= 1, --headroom-pct "
            "in [0, 100)",
            file=sys.stderr,
        )
        return 2
    try:
        result = find_batch_size(
            cfg,
            limit_mb=args.limit_mb,
            headroom_pct=args.headroom_pct,
            start=args.start,
            max_batch=args.max_batch,
            multiple_of=args.multiple_of,
        )
    except RuntimeError as e:
        print(f"batch-find: {e}", file=sys.stderr)
        return 1
    if result.limited_by == "training set":
        print(
            f"batch-find: capped at the training set's {result.train_samples} samples: every "
            "probe up to it fitted, so memory was not the limit",
            file=sys.stderr,
        )
    print(json.dumps(result.model_dump()))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        sys.exit(_child_main())
    sys.exit(
        "usage: python -m hpc_core.batch_find --probe < request.json (see hpc-train batch-find)"
    )
