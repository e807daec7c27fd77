"""The memory plan's probe processes: the real training step, measured at one micro-batch.

A probe trains two steps (and the closing evaluation) of the fine-tune's own config at one
micro-batch and reports two peaks: the start-up's (torch imported, the model loaded, the
trainer built) and the training step's alone (the kernel's high-water mark reset in between);
on CUDA the step's includes the most the caching allocator reserved. The planner
(:mod:`agent.finetune.memory_plan`) fits its line through them.

Forked probes: starting up (torch imported, with the ``torch._dynamo`` its optimizers pull
in, and the model loaded) is most of a small probe's cost: ~2.7 of its ~3.5 CPU-s on x86
here. So the small sizes of one repeat share one start-up (``--forked``): a
fresh process starts up as a probe does, in the same order (so its start-up peak is a probe's),
frees its model and forks a child per size, which loads the weights, builds the trainer and
trains; the server only waits. The children's peaks matched fresh probes' within their noise
(``tests/agent/finetune/test_forked_probes.py``). Each repeat is its own fresh process, so the
spread between repeats is still the noise between processes. Copy-on-write costs the tree
the pages a child writes twice (the server keeps the originals): +5-36 MB of PSS beside a
probe here, so the size the plan picks, near the budget, is verified in fresh processes as
before. The server starts with one OpenMP thread (a team of more is running threads at the
fork, which a child could deadlock on) and each child takes the job's count; where a thread
runs anyway, or a size trains on CUDA, the server refuses and every size is probed fresh. The
planner forks CPU probes only: a process that touched CUDA (even the ``cuInit`` of torch's
default availability check) poisons its forked children's CUDA, and no GPU host has run the
server yet.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from hpc_core.config import TrainConfig, config_from_dict
from registry.lifetime import skip_startup_and_exit_collections

log = logging.getLogger(__name__)


class Probe(NamedTuple):
    """One probe process's peaks (MB; on CUDA the step's includes the memory reserved)."""

    step_mb: float
    startup_mb: float


def probe_config(cfg: TrainConfig, out: Path, micro: int) -> TrainConfig:
    tree = cfg.to_dict()
    tree["run"]["output_dir"] = str(out)
    # Two micro-batches per step, as the planned job accumulates: the second backward adds
    # into existing gradients through a transient copy, and a probe without accumulation
    # peaked 35 MB under the job (a vit at micro-batch 128). Never more than the job's own
    # effective batch: the job steps on no more, and its data may hold no more (a probe at
    # 1,083 of a 1,083 batch asked for 2,166 of 1,707 samples, failed, and a forced
    # micro-batch went unchecked). Two steps, so the optimizer's state exists during the
    # second step's backward.
    tree["training"].update(
        global_batch_size=min(2 * micro, cfg.training.global_batch_size),
        micro_batch_size=micro, max_steps=2, epochs=None,
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
    fresh process that started up once (:func:`probe_forked`), else, or where that process
    found forking unsafe, a fresh process per size (:func:`probe_subprocess`)."""
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
        [sys.executable, "-m", "agent.finetune.memory_probes", str(out / "probe.json")],
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
        [sys.executable, "-m", "agent.finetune.memory_probes", "--forked", str(spec)],
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
            log.debug("memory probe at micro-batch %s: child %s of server %s: %s", out["micro"],
                      out["pid"], out["server"], found[int(out["micro"])])
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


def _measure(cfg: TrainConfig, checkpoint: Path, trainable: str,
             started: float = 0.0) -> dict[str, float]:
    """The probe itself, in this process: load, build, train at ``cfg``'s micro-batch; its
    start-up peak (at least ``started``: a forked child's server started up for it) and its
    training step's peak."""
    from agent.finetune.cold_pages import drop_cold_pages
    from agent.finetune.model import prepare_model
    from hpc_core.metrics import peak_rss_mb, reset_peak_rss
    from hpc_core.trainer import Trainer

    # The fine-tune (agent.finetune.recipe) drops torch's cold pages at the same two points.
    model, _ = prepare_model(checkpoint, trainable)
    drop_cold_pages()
    trainer = Trainer(cfg, model=model)
    drop_cold_pages()
    startup = max(started, peak_rss_mb())
    reset_peak_rss()  # where it cannot be reset, the step's peak includes the start-up's
    trainer.train()
    peak = peak_rss_mb()
    if trainer.device.type == "cuda":
        import torch

        peak += torch.cuda.max_memory_reserved(trainer.device) / 2**20
    return {"peak_mb": peak, "startup_mb": startup}


def _probe_main(spec_path: str) -> None:
    skip_startup_and_exit_collections()
    spec = json.loads(Path(spec_path).read_text())
    print(json.dumps(_measure(config_from_dict(spec["config"]), Path(spec["checkpoint"]),
                              spec["trainable"])))


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
    skip_startup_and_exit_collections()  # as a fresh probe starts up (its peak is theirs)
    spec = json.loads(Path(spec_path).read_text())
    configs = {int(m): config_from_dict(c) for m, c in spec["configs"].items()}
    cuda = [m for m, c in configs.items() if c.training.device == "cuda"]
    if cuda:  # before torch is imported: nothing to start up for
        print(f"micro-batch {cuda[0]} trains on CUDA", file=sys.stderr)
        return FORK_UNSAFE
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
    """One forked child: :func:`_measure` at ``cfg``'s micro-batch; its peaks to ``answer``."""
    code = 1
    try:
        import torch

        from registry.lifetime import die_with_parent

        die_with_parent()  # a server killed at its timeout takes its child along
        os.dup2(2, 1)  # the server's stdout carries the answers alone
        torch.set_num_threads(spec["threads"])
        # The high-water mark restarted at the fork: the server's start-up peak is this
        # child's too, as a fresh probe's imports are part of its own.
        peaks = _measure(cfg, Path(spec["checkpoint"]), spec["trainable"], started)
        os.write(answer, json.dumps({**peaks, "pid": os.getpid(),
                                     "server": os.getppid()}).encode())
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
