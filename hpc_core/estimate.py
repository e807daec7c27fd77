"""Time and cost estimate of a training run from a short probe: ``hpc-train estimate``.

The probe is the real trainer on this machine: a few warm-up steps, then timed optimizer
steps, one evaluation and one checkpoint save. From those it predicts

    total = steps x step_time + evaluations x (eval_time + save_time)

and the cost from ``configs/gpu_prices.yaml``. Every number is printed with the assumption
behind it: the probe's device, how a throughput is carried to another GPU model (ratio of
peak tensor TFLOPS, only when the probe ran on a known GPU), the multi-node scaling
efficiency, and the price table's date.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpc_core.config import ConfigError, TrainConfig, load_config, read_yaml
from registry.validation import format_errors

DEFAULT_PRICES = Path(__file__).resolve().parents[1] / "configs/gpu_prices.yaml"


class GpuPrice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    memory_gb: float = Field(gt=0)
    usd_per_gpu_hour: float = Field(ge=0)
    source: str
    tensor_tflops: float = Field(gt=0)


class PriceTable(BaseModel):
    model_config = ConfigDict(extra="forbid")
    price_date: str
    currency: str = "USD"
    gpus: dict[str, GpuPrice] = Field(min_length=1)


def load_prices(path: Path) -> PriceTable:
    try:
        return PriceTable.model_validate(read_yaml(path))
    except ValidationError as e:
        raise ConfigError(str(path), format_errors(e, PriceTable)) from None


@dataclass
class Probe:
    device: str
    steps: int
    step_s: float
    """Mean seconds per optimizer step after warm-up."""
    samples_per_s: float
    eval_s: float
    save_s: float
    peak_mb: float
    """CUDA: max_memory_allocated; CPU: the process's peak RSS."""


@dataclass
class Estimate:
    gpu: str
    nodes: int
    gpus_per_node: int
    total_steps: int
    steps_per_epoch: int
    evaluations: int
    samples_per_s: float
    epoch_s: float
    total_s: float
    gpu_hours: float
    cost: float
    currency: str
    fits_memory: bool | None
    probe: Probe
    assumptions: list[str] = field(default_factory=list)


def run_probe(cfg: TrainConfig, steps: int = 20, warmup: int = 3) -> tuple[Probe, Any]:
    """Time ``steps`` optimizer steps (after ``warmup``), one evaluation and one save."""
    import torch  # not at import: `hpc-train --help` and the torch-free commands

    from hpc_core.trainer import Trainer

    cfg = cfg.model_copy(deep=True)
    cfg.logging.progress = "off"
    with tempfile.TemporaryDirectory(prefix="estimate-") as scratch:
        cfg.run.output_dir = Path(scratch)
        trainer = Trainer(cfg)
        batches = iter(trainer.train_loader)
        times = []
        for i in range(warmup + steps):
            try:
                x, y = next(batches)
            except StopIteration:
                trainer.sampler.set_epoch(i)
                batches = iter(trainer.train_loader)
                x, y = next(batches)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(x, y)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.evaluate()
        eval_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.save()
        save_s = time.perf_counter() - t0
        if trainer.logger is not None:
            trainer.logger.close()
    from hpc_core.metrics import peak_device_mb, peak_rss_mb

    # The mean, not the median: a run's wall time pays for the slow steps too (GC, page faults).
    step_s = sum(times) / len(times)
    per_rank = cfg.training.global_batch_size // trainer.dist.world_size
    device = trainer.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    probe = Probe(
        device=name, steps=steps, step_s=step_s, samples_per_s=per_rank / step_s,
        eval_s=eval_s, save_s=save_s,
        peak_mb=peak_device_mb(device) or peak_rss_mb(),
    )  # fmt: skip
    return probe, trainer


def _probe_gpu_key(device_name: str, prices: PriceTable) -> str | None:
    """The table entry whose model the probe ran on ("NVIDIA H100 80GB HBM3" -> h100)."""
    low = device_name.lower()
    return next((k for k in prices.gpus if re.search(rf"\b{k}\b", low)), None)


def estimate(
    cfg: TrainConfig,
    gpu: str,
    prices: PriceTable,
    *,
    nodes: int = 1,
    gpus_per_node: int = 1,
    scaling_efficiency: float = 0.9,
    probe_steps: int = 20,
) -> Estimate:
    if gpu not in prices.gpus:
        raise ValueError(
            f"--gpu {gpu!r} is not in the price table (known: {', '.join(prices.gpus)})"
        )
    target = prices.gpus[gpu]
    probe, trainer = run_probe(cfg, steps=probe_steps)
    notes = [
        f"probe: {probe.steps} timed steps on {probe.device} (mean {probe.step_s * 1e3:.1f} ms "
        f"per step of {cfg.training.global_batch_size} samples), one evaluation "
        f"({probe.eval_s:.3f} s), one checkpoint save ({probe.save_s:.3f} s)",
    ]
    per_device = probe.samples_per_s
    source = _probe_gpu_key(probe.device, prices)
    if source is None:
        notes.append(
            f"throughput per {gpu} = the probe's on {probe.device}: it did not run on a GPU "
            f"of the table, so no conversion is possible; run the estimate on a {gpu} for a "
            "measured figure"
        )
        speed = 1.0
    else:
        speed = target.tensor_tflops / prices.gpus[source].tensor_tflops
        notes.append(
            f"throughput per {gpu} = probe on {source} x {speed:.2f} (ratio of peak tensor "
            "TFLOPS: assumes the step is compute-bound)"
        )
    devices = nodes * gpus_per_node
    eff = 1.0 if devices == 1 else scaling_efficiency
    if devices > 1:
        notes.append(
            f"{devices} GPUs at {eff:.0%} scaling efficiency (data-parallel DDP; measure yours "
            "with a short multi-node run and pass --scaling-efficiency)"
        )
    samples_per_s = per_device * speed * devices * eff
    step_s = cfg.training.global_batch_size / samples_per_s
    total_steps, spe = trainer.total_steps, trainer.steps_per_epoch
    every = cfg.training.eval_every_steps
    evals = math.ceil(total_steps / spe) if every is None else math.ceil(total_steps / every)
    eval_save_s = (probe.eval_s / speed) + probe.save_s
    final_save_s = probe.save_s if cfg.checkpoint.save_final else 0.0
    total_s = total_steps * step_s + evals * eval_save_s + final_save_s
    epoch_s = spe * step_s + (eval_save_s if every is None else spe / every * eval_save_s)
    notes.append(
        f"{evals} evaluations, each followed by a checkpoint save (the best-checkpoint upper "
        "bound), and the final save; start-up (imports, data loading) is not included"
    )
    gpu_hours = total_s / 3600 * devices
    notes.append(
        f"price: {target.usd_per_gpu_hour} {prices.currency}/GPU-hour for {target.name} "
        f"({target.source}, price date {prices.price_date})"
    )
    fits = None if source is None else probe.peak_mb <= target.memory_gb * 1024
    notes.append(
        f"peak memory in the probe: {probe.peak_mb:.0f} MB "
        + (
            "(CPU RSS: not comparable to GPU memory)"
            if fits is None
            else f"of {target.memory_gb} GB"
        )
    )
    return Estimate(
        gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node, total_steps=total_steps,
        steps_per_epoch=spe, evaluations=evals, samples_per_s=samples_per_s, epoch_s=epoch_s,
        total_s=total_s, gpu_hours=gpu_hours, cost=gpu_hours * target.usd_per_gpu_hour,
        currency=prices.currency, fits_memory=fits, probe=probe, assumptions=notes,
    )  # fmt: skip


def render(e: Estimate) -> str:
    lines = [
        f"estimate for {e.nodes} node(s) x {e.gpus_per_node} {e.gpu}",
        f"  throughput   {e.samples_per_s:,.0f} samples/s",
        f"  epoch        {_hms(e.epoch_s)}  ({e.steps_per_epoch} steps)",
        f"  total        {_hms(e.total_s)}  ({e.total_steps} steps, {e.evaluations} evaluations)",
        f"  cost         {e.cost:,.2f} {e.currency}  ({e.gpu_hours:.3f} GPU-hours)",
        "assumptions:",
        *[f"  - {a}" for a in e.assumptions],
    ]
    return "\n".join(lines) + "\n"


def _hms(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    h, rem = divmod(round(s), 3600)
    return f"{h}h{rem // 60:02d}m{rem % 60:02d}s"


def add_estimate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gpu", required=True, help="a key of the price table: a100, h100, ...")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--scaling-efficiency", type=float, default=0.9,
                   help="multi-GPU throughput / (GPUs x one GPU's), default 0.9")  # fmt: skip
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--prices", default=str(DEFAULT_PRICES), help="GPU price table (YAML)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")


def run_estimate(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        prices = load_prices(Path(args.prices))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.nodes < 1 or args.gpus_per_node < 1 or not 0 < args.scaling_efficiency <= 1:
        print("--nodes and --gpus-per-node >= 1, 0 < --scaling-efficiency <= 1", file=sys.stderr)
        return 2
    try:
        e = estimate(
            cfg, args.gpu, prices, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
            scaling_efficiency=args.scaling_efficiency, probe_steps=args.probe_steps,
        )  # fmt: skip
    except ValueError as err:
        print(f"estimate: {err}", file=sys.stderr)
        return 2
    print(
        json.dumps(asdict(e), indent=1) if args.json else render(e), end="\n" if args.json else ""
    )
    return 0
