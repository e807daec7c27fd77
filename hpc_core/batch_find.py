"""Batch-size finder: the largest per-process batch one training step fits in memory.

``hpc-train batch-find`` doubles the batch from ``start`` until a step does not fit, then
bisects between the last fit and the first miss. Each probe is one real optimizer step of the
trainer (forward, backward, clipping, optimizer update: the optimizer's state is part of the
peak) at micro-batch = batch. A probe does not fit when it runs out of memory (a real or an
injected OOM, see ``hpc_core.faults``) or its peak exceeds ``limit_mb``:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
- CPU: the process's resident-set high-water mark (VmHWM), reset before each probe through
  ``/proc/self/clear_refs`` so one probe's peak does not hide the next one's.

The trainer's model and optimizer state are restored after every probe, so the caller can
train on with the same trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpc_core.config import ConfigError, load_config
from hpc_core.faults import is_oom
from hpc_core.metrics import peak_rss_mb


@dataclass
class Probe:
    batch: int
    fits: bool
    peak_mb: float | None
    """None when the step ran out of memory before finishing."""


@dataclass
class BatchFindResult:
    batch_size: int
    limit_mb: float | None
    measure: str
    """cuda_max_allocated | cpu_peak_rss"""
    probes: list[Probe] = field(default_factory=list)


def _reset_cpu_peak() -> None:
    # Give freed heap back first, so the reset high-water mark starts from what is live.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset VmHWM (what peak_rss_mb reads) to the current RSS (Linux >= 4.0)


class BatchProber:
    """Runs single training steps of a trainer at a given batch size and restores it after."""

    def __init__(self, trainer: Any, limit_mb: float | None) -> None:
        self.trainer = trainer
        self.limit_mb = limit_mb
        self.cuda = trainer.device.type == "cuda"
        x, y = next(iter(trainer.train_loader))
        self._x, self._y = x, y

    def _batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(n) % len(self._x)  # repeat samples: memory depends on the count only
        return self._x[idx], self._y[idx]

    def probe(self, batch: int) -> Probe:
        t = self.trainer
        model_state = copy.deepcopy(t.raw_model.state_dict())
        opt_state = copy.deepcopy(t.optimizer.state_dict())
        saved = (t.state.micro_batch_size, t.cfg.faults.min_micro_batch_size)
        # min = batch: the trainer's OOM handling raises instead of halving the micro-batch.
        t.state.micro_batch_size = batch
        t.cfg.faults.min_micro_batch_size = batch
        x, y = self._batch(batch)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(t.device)
        else:
            _reset_cpu_peak()
        peak: float | None
        try:
            t.train_step(x, y)
        except Exception as e:
            if not is_oom(e):
                raise
            peak = None
        else:
            peak = (
                torch.cuda.max_memory_allocated(t.device) / 2**20 if self.cuda else peak_rss_mb()
            )
        finally:
            del x, y
            t.optimizer.zero_grad(set_to_none=True)
            t.raw_model.load_state_dict(model_state)
            t.optimizer.load_state_dict(opt_state)
            t.state.micro_batch_size, t.cfg.faults.min_micro_batch_size = saved
        fits = peak is not None and (self.limit_mb is None or peak <= self.limit_mb)
        return Probe(batch, fits, None if peak is None else round(peak, 1))


def find_batch_size(
    trainer: Any, *, limit_mb: float | None = None, start: int = 1, max_batch: int = 65536
) -> BatchFindResult:
    """Largest power of two that fits, then bisection up to the first size that does not."""
    prober = BatchProber(trainer, limit_mb)
    result = BatchFindResult(0, limit_mb, "cuda_max_allocated" if prober.cuda else "cpu_peak_rss")

    def fits(b: int) -> bool:
        p = prober.probe(b)
        result.probes.append(p)
        return p.fits

    if not fits(start):
        raise RuntimeError(
            f"batch {start} does not fit ({result.probes[-1]}): lower start, the model or the "
            "input size, or raise the limit"
        )
    lo, hi = start, None
    while lo * 2 <= max_batch:
        if not fits(lo * 2):
            hi = lo * 2
            break
        lo *= 2
    if hi is None:
        result.batch_size = lo
        return result
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    result.batch_size = lo
    return result


def add_batch_find_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--limit-mb",
        type=float,
        default=None,
        help="memory a step may use: CUDA allocated bytes, or the CPU process's peak RSS "
        "(default: no limit beyond running out of memory)",
    )
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=65536)


def run_batch_find(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from hpc_core.trainer import Trainer

    cfg.logging.progress = "off"
    with tempfile.TemporaryDirectory(prefix="batch-find-") as scratch:
        cfg.run.output_dir = Path(scratch)
        trainer = Trainer(cfg)
        try:
            result = find_batch_size(
                trainer, limit_mb=args.limit_mb, start=args.start, max_batch=args.max_batch
            )
        except RuntimeError as e:
            print(f"batch-find: {e}", file=sys.stderr)
            return 1
        finally:
            if trainer.logger is not None:
                trainer.logger.close()
    print(json.dumps(asdict(result)))
    return 0
