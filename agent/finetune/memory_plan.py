"""Plan the micro-batch before the first step, so a fine-tune fits its memory budget.

Composer-style OOM halving only reacts after the fact, and on a Jetson the first sign of
exhaustion is often the kernel's OOM killer, which no ``except`` catches. So we measure first:
run the real training step at two small micro-batch sizes, fit ``peak = base + per_sample * m``,
and take the largest micro-batch whose predicted peak stays under the budget (with headroom).

Measurement: on CUDA, ``torch.cuda.max_memory_allocated`` in this process; on CPU and unified
memory, the resident-set high-water mark of a probe subprocess (a fresh process, so one probe's
allocator caches do not hide the next one's peak).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc_core.config import TrainConfig, config_from_dict

log = logging.getLogger(__name__)

# Predicted peaks are kept this far under the budget: allocator fragmentation and the
# evaluation pass are not in the linear model.
HEADROOM = 0.92


class BudgetTooSmall(RuntimeError):
    """Even a micro-batch of one does not fit the budget."""


@dataclass(frozen=True)
class MemoryPlan:
    budget_mb: float
    micro_batch_size: int
    accumulation_steps: int
    base_mb: float
    per_sample_mb: float
    predicted_peak_mb: float
    probes: dict[int, float]
    method: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["probes"] = {str(k): v for k, v in self.probes.items()}
        return d


def probe_sizes(effective_batch: int) -> tuple[int, int]:
    small = max(1, min(4, effective_batch // 4))
    large = max(small + 1, min(16, effective_batch))
    return small, large


def fit_plan(
    budget_mb: float, effective_batch: int, probes: dict[int, float], method: str
) -> MemoryPlan:
    (m1, p1), (m2, p2) = sorted(probes.items())[:2]
    per_sample = max((p2 - p1) / (m2 - m1), 1e-6)
    base = p1 - per_sample * m1
    limit = budget_mb * HEADROOM
    fit = int((limit - base) // per_sample)
    if fit < 1:
        raise BudgetTooSmall(
            f"budget {budget_mb:.0f} MB is below what one sample needs "
            f"(~{base + per_sample:.0f} MB: "
            f"{base:.0f} MB fixed + {per_sample:.1f} MB/sample): raise --budget-mb, train fewer "
            "layers (--trainable head) or use smaller inputs"
        )
    micro = min(fit, effective_batch)
    # Prefer a divisor of the effective batch: every micro-step then has the same shape.
    divisors = [d for d in range(micro, 0, -1) if effective_batch % d == 0]
    if divisors and divisors[0] * 2 > micro:
        micro = divisors[0]
    return MemoryPlan(
        budget_mb=budget_mb,
        micro_batch_size=micro,
        accumulation_steps=-(-effective_batch // micro),
        base_mb=round(base, 1),
        per_sample_mb=round(per_sample, 3),
        predicted_peak_mb=round(base + per_sample * micro, 1),
        probes=probes,
        method=method,
    )


def plan_micro_batch(
    cfg: TrainConfig, init_checkpoint: Path, trainable: str, budget_mb: float, device: str
) -> MemoryPlan:
    """Probe two micro-batch sizes of the real job and fit the largest that fits."""
    effective = cfg.training.global_batch_size
    sizes = probe_sizes(effective)
    if device == "cuda":
        probes = {m: _probe_cuda(cfg, init_checkpoint, trainable, m) for m in sizes}
        method = "cuda max_memory_allocated"
    else:
        probes = {m: probe_subprocess(cfg, init_checkpoint, trainable, m) for m in sizes}
        method = "probe subprocess peak RSS"
    plan = fit_plan(budget_mb, effective, probes, method)
    log.info(
        "memory plan: micro-batch %d x %d accumulation (predicted %.0f MB of %.0f MB; probes %s)",
        plan.micro_batch_size,
        plan.accumulation_steps,
        plan.predicted_peak_mb,
        budget_mb,
        {m: round(v) for m, v in probes.items()},
    )
    return plan


def probe_config(cfg: TrainConfig, out: Path, micro: int) -> TrainConfig:
    tree = cfg.to_dict()
    tree["run"]["output_dir"] = str(out)
    tree["training"].update(
        global_batch_size=micro, micro_batch_size=micro, max_steps=2, epochs=None
    )
    tree["checkpoint"].update(every_steps=None, save_final=False, best_metric=None)
    tree["logging"]["progress"] = "off"
    return config_from_dict(tree)


def probe_subprocess(cfg: TrainConfig, init_checkpoint: Path, trainable: str, micro: int) -> float:
    out = cfg.run.output_dir / "probes" / f"m{micro}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "config": probe_config(cfg, out, micro).to_dict(),
        "checkpoint": str(init_checkpoint),
        "trainable": trainable,
    }
    (out / "probe.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    p = subprocess.run(
        [sys.executable, "-m", "agent.finetune.memory_plan", str(out / "probe.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if p.returncode != 0:
        raise RuntimeError(f"memory probe at micro-batch {micro} failed:\n{p.stderr[-2000:]}")
    return float(json.loads(p.stdout.strip().splitlines()[-1])["peak_mb"])


def _probe_cuda(cfg: TrainConfig, init_checkpoint: Path, trainable: str, micro: int) -> float:
    import torch

    from agent.finetune.model import prepare_model
    from hpc_core.trainer import Trainer

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pcfg = probe_config(cfg, cfg.run.output_dir / "probes" / f"m{micro}", micro)
    Trainer(pcfg, model=prepare_model(init_checkpoint, trainable)[0]).train()
    return torch.cuda.max_memory_allocated() / 2**20


def _probe_main(spec_path: str) -> None:
    from agent.finetune.model import prepare_model
    from hpc_core.metrics import peak_rss_mb
    from hpc_core.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = config_from_dict(spec["config"])
    model, _ = prepare_model(Path(spec["checkpoint"]), spec["trainable"])
    Trainer(cfg, model=model).train()
    print(json.dumps({"peak_mb": peak_rss_mb()}))


if __name__ == "__main__":
    _probe_main(sys.argv[1])
