"""The micro-batch plan for a budget that covers the job's whole process tree.

The worker (this process, torch-free) stays alive while the probes and then the fine-tune
child run, so its own RSS comes off the budget first. Probe peaks are noisy (allocator and
page-cache effects: identical runs gave 2.3-3.8 MB/sample), so each of three sizes is probed
twice, the line is fitted through the worst probe of each size, and the spread between
repeats plus the worst residual is kept as a margin.

Probe peaks do not depend on the budget, so they are kept in a small cache keyed by what
they do depend on (the probe's training config, the starting weights, the trainable layers,
the micro-batch, the torch version): a device that fine-tunes the same model again, at any
budget, plans at once instead of spending a minute on six probe processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from agent.finetune.memory_plan import HEADROOM, BudgetTooSmall, probe_config, probe_subprocess
from agent.jobs.proctree import rss_mb
from hpc_core.atomic import write_json_atomic
from hpc_core.config import TrainConfig, config_from_dict

REPEATS = 2
CACHE_ENTRIES = 64


def probe_points(effective_batch: int) -> list[int]:
    top = max(1, min(16, effective_batch))
    return sorted({max(1, top // 4), max(1, top // 2), top})


def fit(points: dict[int, list[float]]) -> tuple[float, float, float]:
    """(base, per_sample, margin) from the worst peak at each size."""
    xs = sorted(points)
    ys = [max(points[m]) for m in xs]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(slope, 1e-3)
    base = my - slope * mx
    residual = max(abs(y - (base + slope * x)) for x, y in zip(xs, ys, strict=True))
    spread = max(max(v) - min(v) for v in points.values())
    return base, slope, residual + spread


def probe_key(cfg: TrainConfig, init: Path, trainable: str, micro: int) -> str:
    """What a probe's peak depends on; the job's own folder and step count do not count."""
    tree = probe_config(cfg, Path("-"), micro).to_dict()
    tree["run"].pop("output_dir", None)
    weights = init / "manifest.json"  # signed tensor hashes: the weights' identity
    if not weights.is_file():
        weights = next(init.glob("*.safetensors"), init)
    ident = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else str(init)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "?"
    blob = json.dumps([tree, ident, trainable, micro, torch_version, sys.version], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _read_cache(path: Path) -> dict[str, list[float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: probe again
    return {k: v for k, v in data.items()
            if isinstance(v, list) and len(v) == REPEATS and all(
                isinstance(x, (int, float)) for x in v)} if isinstance(data, dict) else {}


def plan_for_tree(
    cfg: dict[str, Any], init: Path, trainable: str, budget_mb: float, probes_dir: Path,
    cache: Path | None = None,
) -> dict[str, Any]:
    """The micro-batch for ``budget_mb`` over the whole tree; ``cache`` (a JSON file) keeps
    probe peaks for the next job with the same model and training config."""
    train_cfg = config_from_dict(cfg["config"])
    effective = train_cfg.training.global_batch_size
    # A probe's closing evaluation covers the validation split at the probe's micro-batch
    # under no_grad: a quarter of its time and never its peak. A 5% split keeps it short;
    # the arrays loaded (the whole data set) and the training step are the same.
    train_cfg = train_cfg.model_copy(update={
        "run": train_cfg.run.model_copy(update={"output_dir": probes_dir}),
        "data": train_cfg.data.model_copy(
            update={"val_fraction": min(train_cfg.data.val_fraction, 0.05)}),
    })
    cached = _read_cache(cache) if cache is not None else {}
    points: dict[int, list[float]] = {}
    keys: dict[int, str] = {}
    for m in probe_points(effective):
        keys[m] = probe_key(train_cfg, init, trainable, m)
        points[m] = cached.get(keys[m]) or [
            probe_subprocess(train_cfg, init, trainable, m) for _ in range(REPEATS)]
    reused = all(k in cached for k in keys.values())
    if cache is not None and not reused:
        cached.update({keys[m]: points[m] for m in points})
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache, dict(list(cached.items())[-CACHE_ENTRIES:]))
    base, per_sample, margin = fit(points)
    worker = rss_mb(os.getpid())
    limit = budget_mb * HEADROOM - worker - margin
    micro = int((limit - base) // per_sample)
    if micro < 1:
        raise BudgetTooSmall(
            f"finetune.budget_mb={budget_mb:.0f}: the job's tree needs "
            f"~{worker + base + margin + per_sample:.0f} MB for one sample ({worker:.0f} MB job "
            f"process + {base:.0f} MB fixed + "
            f"{per_sample:.1f} MB/sample + {margin:.0f} MB noise margin): raise the budget or "
            "train fewer layers (--trainable head)"
        )
    micro = min(micro, effective)
    divisors = [d for d in range(micro, 0, -1) if effective % d == 0]
    if divisors and divisors[0] * 2 > micro:
        micro = divisors[0]
    return {
        "budget_mb": budget_mb, "micro_batch_size": micro,
        "accumulation_steps": -(-effective // micro), "base_mb": round(base, 1),
        "per_sample_mb": round(per_sample, 3), "margin_mb": round(margin, 1),
        "job_process_mb": round(worker, 1),
        "predicted_tree_peak_mb": round(worker + base + per_sample * micro, 1),
        "probes": {str(k): [round(v, 1) for v in vs] for k, vs in points.items()},
        "probes_reused": reused,
        "method": "probe subprocess peak RSS, 3 sizes x 2, whole-tree budget",
    }
