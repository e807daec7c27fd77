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

Forked probes: starting up (torch imported, with the ``torch._dynamo`` its optimizers pull
in, and the model loaded) is most of a small probe's cost: ~2.7 of its ~3.5 CPU-s on x86 here,
more on a Jetson's cores. So the small sizes of one repeat share one start-up (``--forked``): a
fresh process starts up as a probe does, in the same order (so its start-up peak is a probe's),
frees its model and forks a child per size, which loads the weights, builds the trainer and
trains; the server only waits. The children's peaks matched fresh probes' within their noise
(``tests/agent/finetune/test_forked_probes.py``). Each repeat is its own fresh process, so the
spread between repeats is still the noise between processes. Copy-on-write costs the tree
the pages a child writes twice (the server keeps the originals): +5-30 MB of PSS beside a
probe here, so the size the plan picks, near the budget, is verified in fresh processes as
before. The server starts with one OpenMP thread (a team of more is running threads at the
fork, which a child could deadlock on) and each child takes the job's count; where a thread
runs anyway, or CUDA is initialized, the server refuses and every size is probed fresh.

Cache: probe peaks do not depend on the budget, so they are kept in a small JSON file keyed by
what they do depend on (the probe's training config, the starting weights, the trainable
layers, the micro-batch, the torch and Python versions): a device that fine-tunes the same
model again, at any budget, plans at once instead of spending a minute on six probes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

from agent.finetune.memory_fits import MemoryFit, largest_micro_batch
from hpc_core.config import TrainConfig, config_from_dict
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


class Probe(NamedTuple):
    """One probe process's peaks (MB; on CUDA the step's includes the memory reserved)."""

    step_mb: float
    startup_mb: float


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

    def line(self) -> MemoryFit:
        """The fitted line this plan was cut from (what a forced micro-batch is judged by)."""
        return MemoryFit(self.base_mb, self.per_sample_mb, self.margin_mb, self.job_process_mb,
                         self.startup_mb)

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
    points = measure(sizes, fork=True)
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


def probe_config(cfg: TrainConfig, out: Path, micro: int) -> TrainConfig:
    tree = cfg.to_dict()
    tree["run"]["output_dir"] = str(out)
    # Two micro-batches per step, as the planned job accumulates: the second backward adds
    # into existing gradients through a transient copy, and a probe without accumulation
    # peaked 35 MB under the job (a vit at micro-batch 128). Two steps, so the optimizer's
    # state exists during the second step's backward.
    tree["training"].update(
        global_batch_size=2 * micro, micro_batch_size=micro, max_steps=2, epochs=None
    )
    tree["checkpoint"].update(every_steps=None, save_final=False, best_metric=None)
    tree["logging"]["progress"] = "off"
    return config_from_dict(tree)


PROBE_TIMEOUT_S = 600
FORK_UNSAFE = 75
"""The ``--forked`` server's exit status where it cannot fork safely (EX_TEMPFAIL): the
planner probes each size in a fresh process instead."""


def run_probes(cfg: TrainConfig, init_checkpoint: Path, trainable: str, sizes: Sequence[int], *,
               fork: bool) -> dict[int, Probe]:
    """One repeat's probes at ``sizes``: with ``fork`` (and more than one size) children of one
    fresh process that imported the libraries once (:func:`probe_forked`), else a fresh
    process per size (:func:`probe_subprocess`)."""
    if fork and len(sizes) > 1:
        found = probe_forked(cfg, init_checkpoint, trainable, sizes)
        if found is not None:
            return found
    return {m: probe_subprocess(cfg, init_checkpoint, trainable, m) for m in sizes}


def _probe_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def probe_subprocess(cfg: TrainConfig, init_checkpoint: Path, trainable: str, micro: int) -> Probe:
    out = cfg.run.output_dir / "probes" / f"m{micro}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "config": probe_config(cfg, out, micro).to_dict(),
        "checkpoint": str(init_checkpoint),
        "trainable": trainable,
    }
    (out / "probe.json").write_text(json.dumps(spec))
    p = subprocess.run(
        [sys.executable, "-m", "agent.finetune.memory_plan", str(out / "probe.json")],
        capture_output=True,
        text=True,
        env=_probe_env(),
        timeout=PROBE_TIMEOUT_S,
    )
    if p.returncode != 0:
        raise RuntimeError(f"memory probe at micro-batch {micro} failed:\n{p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return Probe(float(out["peak_mb"]), float(out["startup_mb"]))


def probe_forked(cfg: TrainConfig, init_checkpoint: Path, trainable: str,
                 sizes: Sequence[int]) -> dict[int, Probe] | None:
    """Every size's probe as a forked child of one fresh process (``--forked``); None where
    that process found forking unsafe. Raises RuntimeError naming the first size whose child
    failed (its error follows), as :func:`probe_subprocess` does."""
    root = cfg.run.output_dir / "probes"
    configs = {}
    for m in sizes:
        (root / f"m{m}").mkdir(parents=True, exist_ok=True)
        configs[str(m)] = probe_config(cfg, root / f"m{m}", m).to_dict()
    env = _probe_env()
    if not env["OMP_NUM_THREADS"].isdigit():  # a nested list ("4,2"): a fresh process reads it
        return None
    spec = root / "forked.json"
    spec.write_text(json.dumps({"configs": configs, "checkpoint": str(init_checkpoint),
                                "trainable": trainable,
                                "threads": int(env["OMP_NUM_THREADS"])}))
    p = subprocess.run(
        [sys.executable, "-m", "agent.finetune.memory_plan", "--forked", str(spec)],
        capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"},
        timeout=PROBE_TIMEOUT_S * len(sizes))
    if p.returncode == FORK_UNSAFE:
        log.warning("memory plan: probing each size in a fresh process: %s",
                    p.stderr.strip()[-300:])
        return None
    found = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            out = json.loads(line)
            found[int(out["micro"])] = Probe(float(out["peak_mb"]), float(out["startup_mb"]))
    missing = [m for m in sizes if m not in found]
    if p.returncode != 0 or missing:
        micro = missing[0] if missing else sizes[-1]
        raise RuntimeError(f"memory probe at micro-batch {micro} failed:\n{p.stderr[-2000:]}")
    return found


def fork_blocker() -> str | None:
    """Why this process must not fork a probe, or None: a second thread (a lock it holds, an
    OpenMP team, would stay held in the child forever), CUDA initialized (a forked child cannot
    use it), or no ``/proc`` to tell."""
    if not hasattr(os, "fork"):
        return "this platform cannot fork"
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return "no /proc/self/task to count this process's threads"
    if threads != 1:
        return f"{threads} threads are running in the probe process"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized in the probe process"
    return None


def _probe_main(spec_path: str) -> None:
    from agent.finetune.cold_pages import drop_cold_pages
    from agent.finetune.model import prepare_model
    from hpc_core.metrics import peak_rss_mb, reset_peak_rss
    from hpc_core.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = config_from_dict(spec["config"])
    # The fine-tune (agent.finetune.recipe) drops torch's cold pages at the same two points.
    model, _ = prepare_model(Path(spec["checkpoint"]), spec["trainable"])
    drop_cold_pages()
    trainer = Trainer(cfg, model=model)
    drop_cold_pages()
    startup = peak_rss_mb()
    reset_peak_rss()  # where it cannot be reset, the step's peak includes the start-up's
    trainer.train()
    peak = peak_rss_mb()
    if trainer.device.type == "cuda":
        import torch

        peak += torch.cuda.max_memory_reserved(trainer.device) / 2**20
    print(json.dumps({"peak_mb": peak, "startup_mb": startup}))


def _forked_main(spec_path: str) -> int:
    """``--forked SPEC``: start up once as a fresh probe does, then fork one child per size,
    which loads the weights, builds the trainer and trains; this process only waits. Started
    with one OpenMP thread (a team of more would be running threads at the fork); each child
    takes the job's thread count."""
    import gc

    from agent.finetune.cold_pages import drop_cold_pages
    from agent.finetune.model import prepare_model
    from hpc_core.metrics import peak_rss_mb
    from hpc_core.trainer import Trainer  # noqa: F401 - the child's imports, made here once
    from registry.lifetime import die_with_parent

    die_with_parent()
    spec = json.loads(Path(spec_path).read_text())
    configs = {int(m): config_from_dict(c) for m, c in spec["configs"].items()}
    # A fresh probe's start-up, in its order, so that its peak is this process's: the model
    # loaded, the cold library pages dropped, the optimizer's torch._dynamo, dropped again.
    model, _ = prepare_model(Path(spec["checkpoint"]), spec["trainable"])
    drop_cold_pages()
    import torch._dynamo  # noqa: F401 - imported for its pages, not its names

    drop_cold_pages()
    started = peak_rss_mb()
    del model  # each child loads its own, as the fine-tune will
    gc.collect()
    gc.freeze()  # the collector never touches (so never copies) what the children share
    why = fork_blocker()
    if why is not None:
        print(why, file=sys.stderr)
        return FORK_UNSAFE
    sys.stdout.flush()
    sys.stderr.flush()
    for m, cfg in sorted(configs.items()):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _forked_probe(cfg, spec, started, write)  # never returns
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            answer = pipe.read()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not answer:
            how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
            print(f"memory probe at micro-batch {m} failed ({how})", file=sys.stderr)
            return 1
        print(json.dumps({"micro": m, **json.loads(answer)}), flush=True)
    return 0


def _forked_probe(cfg: TrainConfig, spec: dict[str, Any], started: float, answer: int) -> None:
    """One forked child: load, build, train at ``cfg``'s micro-batch; its peaks to ``answer``."""
    code = 1
    try:
        import torch

        from agent.finetune.cold_pages import drop_cold_pages
        from agent.finetune.model import prepare_model
        from hpc_core.metrics import peak_rss_mb, reset_peak_rss
        from hpc_core.trainer import Trainer
        from registry.lifetime import die_with_parent

        die_with_parent()  # a server killed at its timeout takes its child along
        os.dup2(2, 1)  # the server's stdout carries the answers alone
        torch.set_num_threads(spec["threads"])
        model, _ = prepare_model(Path(spec["checkpoint"]), spec["trainable"])
        drop_cold_pages()
        trainer = Trainer(cfg, model=model)
        drop_cold_pages()
        # The high-water mark restarted at the fork: the server's start-up peak is this
        # child's too, as a fresh probe's imports are part of its own.
        startup = max(started, peak_rss_mb())
        reset_peak_rss()
        trainer.train()
        peak = peak_rss_mb()
        if trainer.device.type == "cuda":
            peak += torch.cuda.max_memory_reserved(trainer.device) / 2**20
        os.write(answer, json.dumps({"peak_mb": peak, "startup_mb": startup,
                                     "pid": os.getpid(), "server": os.getppid()}).encode())
        code = 0
    except BaseException:  # reported on stderr; the server names the size
        import traceback

        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)  # no atexit handlers, no flush of buffers the server owns


if __name__ == "__main__":
    if sys.argv[1] == "--forked":
        sys.exit(_forked_main(sys.argv[2]))
    _probe_main(sys.argv[1])
