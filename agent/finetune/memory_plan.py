"""Plan the micro-batch before the first step, so a fine-tune fits its memory budget.

Composer-style OOM halving only reacts after the fact, and on a Jetson the first sign of
exhaustion is often the kernel's OOM killer, which no ``except`` catches. So we measure first:
run the real training step (and its closing evaluation) at three small micro-batch sizes, fit
``peak = base + per_sample * m``, and take the largest micro-batch whose predicted peak stays
under the budget.

Measurement: the resident-set high-water mark of a probe process (never the planner's own:
one probe's allocator caches would hide the next one's peak), plus, on CUDA, the most the caching
allocator reserved from the device (``max_memory_reserved``: on a Jetson's unified memory that
comes out of the same DRAM, and the allocator keeps what it reserved, so allocated alone
under-counts). The profile's budget is RSS plus GPU memory on every board; the sum of the two
peaks bounds their peak sum from above. The budget covers the whole process tree: a process
that stays alive while the fine-tune runs (the device job's worker) passes its own RSS as
``job_process_mb`` and it comes off the budget first.

Start-up: a fine-tune process peaks once before its first step (torch imported, the model
loaded, its cold library pages not yet dropped) at a height that does not depend on the
micro-batch but does on how the libraries sit in the page cache. So a probe reports two
peaks: the start-up's, then the training step's alone (the kernel's high-water mark reset in
between), and the line is fitted to the steps; the plan keeps both under the budget.

Noise: RSS peaks of identical runs differed by up to 1.5 MB/sample, enough to pick 32 or 64
at random. Each size is probed twice, the line goes through the worst probe of each size, and
the spread between repeats plus the worst residual is kept as a margin.

Verification: the three sizes are small (at most 16) so that probing is cheap and never
itself over the budget, but a plan eight times past them carries the slope's error eight
times: a vit fitted 0.9 MB/sample at 4-16 and peaked at 1.27 MB/sample at 128, 40 MB over
its prediction. So the chosen size is probed as well and the line refitted through it, until
the plan lands on a size that was measured.

Probing: one fresh process per repeat starts up once and forks a child per small size; the
chosen size is verified in fresh processes (:mod:`agent.finetune.memory_probes`).

Cache: probe peaks do not depend on the budget, so they are kept in a small JSON file keyed by
what they do depend on (the probe's training config, the starting weights, the trainable
layers, the micro-batch, the torch and Python versions): a device that fine-tunes the same
model again, at any budget, plans at once instead of spending a minute on six probes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from agent.finetune.memory_fits import MemoryFit, forced_refusal, largest_micro_batch
from agent.finetune.memory_probes import Probe, probe_config, run_probes
from hpc_core.config import TrainConfig
from registry.atomic import write_json_atomic

log = logging.getLogger(__name__)

# No headroom beyond the measured noise margin: the probes run the real step and its
# evaluation, and the whole tree's peak came within 3 MB of the prediction in every run. A
# torch process's fixed cost is ~255-270 MB on CPU here once its cold library pages are
# dropped and fault back one page at a time (agent.finetune.cold_pages, .page_faults; 330-400
# MB before, depending on the page cache), so a fixed percentage of headroom would refuse
# 450 MB budgets that the tree holds.
REPEATS = 2
CACHE_ENTRIES = 64
VERIFY_ROUNDS = 3  # one round settled every plan measured here; a cap, not a target


class BudgetTooSmall(RuntimeError):
    """Even a micro-batch of one does not fit the budget; ``line`` is the fit that says so."""

    def __init__(self, message: str, line: MemoryFit) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True)
class MemoryPlan:
    budget_mb: float
    micro_batch_size: int
    accumulation_steps: int
    base_mb: float
    per_sample_mb: float
    margin_mb: float
    job_process_mb: float
    startup_mb: float
    predicted_tree_peak_mb: float
    probes: dict[int, list[float]]
    method: str
    probes_reused: bool = False
    failed: tuple[int, ...] = ()
    """Sizes whose probe did not finish (the kernel's OOM killer, say): past the plan's reach
    even where the line says they fit."""

    def line(self) -> MemoryFit:
        """The fitted line this plan was cut from (what a forced micro-batch is judged by)."""
        return MemoryFit(self.base_mb, self.per_sample_mb, self.margin_mb, self.job_process_mb,
                         self.startup_mb)

    def refusal(self, micro: int) -> str | None:
        """Why a micro-batch forced beside this plan's budget cannot run within it, or None:
        judged by the line, and never at or past a size whose own probe went over the budget
        or did not finish."""
        return forced_refusal(micro, self.budget_mb, self.line(), probes_over(
            self.probes, self.budget_mb, self.job_process_mb, self.failed, self.startup_mb))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["probes"] = {str(k): [round(v, 1) for v in vs] for k, vs in self.probes.items()}
        return d


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


def probes_over(points: dict[int, list[float]], budget_mb: float, job_process_mb: float,
                failed: Collection[int] = (), startup_mb: float = 0.0) -> list[int]:
    """The sizes whose own probe went past the budget (or did not finish)."""
    return [m for m, v in points.items()
            if job_process_mb + max(startup_mb, *v) > budget_mb] + [*failed]


def fit_plan(
    budget_mb: float, effective_batch: int, points: dict[int, list[float]], method: str, *,
    job_process_mb: float = 0.0, startup_mb: float = 0.0, probes_reused: bool = False,
    failed: Collection[int] = (),
) -> MemoryPlan:
    """The largest micro-batch (a divisor of the effective batch where one is close) whose
    predicted tree peak, plus the noise margin, stays within ``budget_mb``, below every size
    in ``failed`` (probes that did not finish: the kernel's OOM killer, say). ``points`` are
    the training steps' peaks; ``startup_mb`` the probes' worst peak before their step."""
    base, per_sample, margin = fit(points)
    line = MemoryFit(base, per_sample, margin, job_process_mb, startup_mb)
    # Never at or past a size whose own probe went over: the line is a fit, the probe is a fact.
    micro = largest_micro_batch(line, budget_mb, probes_over(points, budget_mb, job_process_mb,
                                                             failed, startup_mb))
    if micro < 1:
        parts = (f"{job_process_mb:.0f} MB job process + " if job_process_mb else "")
        if startup_mb > base + per_sample:
            parts += f"{startup_mb:.0f} MB start-up peak (torch, the model) + "
        else:
            parts += f"{base:.0f} MB fixed + {per_sample:.1f} MB/sample + "
        raise BudgetTooSmall(
            f"finetune.budget_mb={budget_mb:.0f}: the job's tree needs "
            f"~{line.peak_mb(1) + margin:.0f} MB for one sample "
            f"({parts}{margin:.0f} MB noise margin): raise the budget or train fewer layers "
            "(--trainable head)", line)
    micro = min(micro, effective_batch)
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
        margin_mb=round(margin, 1),
        job_process_mb=round(job_process_mb, 1),
        startup_mb=round(startup_mb, 1),
        predicted_tree_peak_mb=round(line.peak_mb(micro), 1),
        probes=points,
        method=method,
        probes_reused=probes_reused,
        failed=tuple(sorted(failed)),
    )


def plan_micro_batch(
    cfg: TrainConfig, init_checkpoint: Path, trainable: str, budget_mb: float, *,
    device: str = "cpu", job_process_mb: float = 0.0, cache: Path | None = None,
) -> MemoryPlan:
    """Probe the real job at three micro-batch sizes (CPU: twice each, in subprocesses under
    ``cfg.run.output_dir / "probes"``) and fit the largest micro-batch that fits."""
    effective = cfg.training.global_batch_size
    # A probe's closing evaluation covers the validation split at the probe's micro-batch
    # under no_grad: a quarter of its time and never its peak. A 5% split keeps it short;
    # the arrays loaded (the whole data set) and the training step are the same.
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(
        update={"val_fraction": min(cfg.data.val_fraction, 0.05)})})
    sizes = probe_points(effective)
    cached = _read_cache(cache) if cache is not None else {}
    keys: dict[int, str] = {}
    probes: dict[int, list[Probe]] = {}

    def measure(wanted: Sequence[int], *, fork: bool) -> dict[int, list[float]]:
        todo = []
        for m in wanted:
            keys[m] = probe_key(cfg, init_checkpoint, trainable, m)
            if keys[m] in cached:
                probes[m] = cached[keys[m]]
            else:
                todo.append(m)
        if todo:  # REPEATS fresh processes, each probing every size
            runs = [run_probes(cfg, init_checkpoint, trainable, todo, fork=fork)
                    for _ in range(REPEATS)]
            probes.update({m: [run[m] for run in runs] for m in todo})
        return {m: [p.step_mb for p in probes[m]] for m in wanted}

    def startup() -> float:
        return max(p.startup_mb for ps in probes.values() for p in ps)
    method = ("probe subprocess peak RSS" + (" + CUDA reserved" if device == "cuda" else "")
              + f", {len(sizes)} sizes x {REPEATS}"
              + (", whole-tree budget" if job_process_mb else ""))
    # Forked only on CPU: a process that once touched CUDA (even cuInit, which torch's default
    # availability check runs) poisons its forked children's CUDA, and no GPU host has run the
    # forked server yet.
    points = measure(sizes, fork=device == "cpu")
    plan = fit_plan(budget_mb, effective, points, method, job_process_mb=job_process_mb,
                    startup_mb=startup())
    failed: list[int] = []
    for _ in range(VERIFY_ROUNDS):
        m = plan.micro_batch_size
        if m in points:
            break
        try:  # in fresh processes: the tree near the budget carries no forked copies
            points.update(measure([m], fork=False))
        except RuntimeError as e:  # past the line's reach (killed for memory): stay below it
            log.warning("memory plan: the probe at micro-batch %d failed; planning below it: "
                        "%s", m, str(e)[-300:])
            failed.append(m)
        plan = fit_plan(budget_mb, effective, points, method + ", verified at the plan",
                        job_process_mb=job_process_mb, startup_mb=startup(), failed=failed)
    reused = all(k in cached for k in keys.values())
    if cache is not None and not reused:
        cached.update({keys[m]: probes[m] for m in points})
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache, dict(list(cached.items())[-CACHE_ENTRIES:]))
    plan = replace(plan, probes_reused=reused)
    log.info("memory plan: micro-batch %d x %d accumulation (predicted %.0f MB of %.0f MB; "
             "probes %s)", plan.micro_batch_size, plan.accumulation_steps,
             plan.predicted_tree_peak_mb, budget_mb, plan.to_dict()["probes"])
    return plan


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


def _read_cache(path: Path) -> dict[str, list[Probe]]:
    """Each key's ``REPEATS`` probes as ``[step_mb, startup_mb]`` pairs; anything else (a
    damaged file, an entry of an older layout) is probed again."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: probe again
    if not isinstance(data, dict):
        return {}
    return {k: [Probe(float(x[0]), float(x[1])) for x in v] for k, v in data.items()
            if isinstance(v, list) and len(v) == REPEATS and all(
                isinstance(x, list) and len(x) == 2
                and all(isinstance(y, (int, float)) for y in x) for x in v)}
