"""The memory plan's probes: a fresh process per size against one start-up forked per size.

Before a device fine-tune trains, ``agent.finetune.memory_plan`` probes its training step at
three small micro-batches, twice each, to fit the largest micro-batch its budget holds. Each
probe was a fresh process, and starting up (torch, the ``torch._dynamo`` every optimizer
imports, the model) is most of a small probe's cost. Now each repeat is one fresh process that
starts up once and forks a child per size (``agent.finetune.memory_probes``, ``--forked``).
Measured here, alternating, on a real checkpoint (two steps of a digits model, trained
first) and a device's data set (``scripts/make_device_data.py``): both ways of one plan's
probes (the three sizes, twice), their CPU (user + system of every process, from
``getrusage``) and wall time, and the step and start-up peaks each way reports, which must
agree within the probes' noise. Verdict: the forked probes' CPU / the fresh probes' (target
<= 0.5).

    python benchmarks/probes.py [--rounds 3] [--model small_cnn] [--image-size 16]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

from benchmarks.harness import cpu_line, fmt, parse_args, verdict  # noqa: E402

TARGET = 0.5
AGREE_MB = 12.0
"""Fresh probes of one size differ by a few MB between processes; more is a measuring error."""


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="plans probed each way (median)")
    ap.add_argument("--model", default="small_cnn", help="hpc_core model name (digits data)")
    ap.add_argument("--image-size", type=int, default=16, help="input side, pixels")
    ap.add_argument("--repeats", type=int, default=None,
                    help="repeats of each size, each way (default: the planner's, 2)")
    a = parse_args(ap, {"rounds": 1, "image_size": 8, "repeats": 1})
    if a.rounds < 1 or (a.repeats is not None and a.repeats < 1):
        ap.error("--rounds and --repeats must be at least 1")
    from agent.finetune.memory_plan import REPEATS, probe_points
    from agent.finetune.memory_probes import run_probes
    from hpc_core.config import load_config
    from hpc_core.trainer import Trainer

    repeats = a.repeats or REPEATS
    print(f"host: {cpu_line()}")
    print(f"python {sys.version.split()[0]}; command: python benchmarks/probes.py --rounds "
          f"{a.rounds} --model {a.model} --image-size {a.image_size} --repeats {repeats}"
          f"{' --quick' if a.quick else ''}\n")
    with tempfile.TemporaryDirectory(prefix="probes-bench-") as tmp:
        root = Path(tmp)
        sets = [f"data.image_size={a.image_size}", "logging.progress=off",
                f"model.name={a.model}", "model.kwargs={}"]
        Trainer(load_config(REPO / "configs/digits.yaml", [
            f"run.output_dir={root / 'up'}", "training.max_steps=2", *sets])).train()
        start = root / "up" / "checkpoints" / "final"
        # The device's own data set, as a device job reads it (an .npz of its camera's images).
        sys.path.insert(0, str(REPO / "scripts"))
        from make_device_data import make_device_data

        data = make_device_data(root / "device.npz", ["invert", "noise"], a.image_size)
        sizes = probe_points(16)
        cpu: dict[bool, list[float]] = {False: [], True: []}
        wall: dict[bool, list[float]] = {False: [], True: []}
        peaks: dict[bool, dict[int, list[float]]] = {False: {}, True: {}}
        startup: dict[bool, list[float]] = {False: [], True: []}
        for r in range(a.rounds):
            for fork in (False, True):
                cfg = load_config(REPO / "configs/digits.yaml", [
                    f"run.output_dir={root / f'job-{r}-{fork}'}",
                    "training.global_batch_size=16", "training.device=cpu", "data.source=npz",
                    f"data.path={data}",
                    *sets])
                c0, t0 = children_cpu(), time.perf_counter()
                runs = [run_probes(cfg, start, "all", sizes, fork=fork) for _ in range(repeats)]
                wall[fork].append(time.perf_counter() - t0)
                cpu[fork].append(children_cpu() - c0)
                for run in runs:
                    for m, probe in run.items():
                        peaks[fork].setdefault(m, []).append(probe.step_mb)
                        startup[fork].append(probe.startup_mb)
        print(f"one plan's probes: sizes {sizes}, {repeats} repeats; median of {a.rounds}")
        print(f"{'way':<34} {'CPU s':>7} {'wall s':>7} "
              + " ".join(f"{f'step@{m} MB':>11}" for m in sizes) + f" {'start-up MB':>12}")
        for fork, name in ((False, "fresh process per size (before)"),
                           (True, "one start-up, forked per size")):
            print(f"{name:<34} {fmt(statistics.median(cpu[fork])):>7} "
                  f"{fmt(statistics.median(wall[fork])):>7} "
                  + " ".join(f"{fmt(statistics.mean(peaks[fork][m])):>11}" for m in sizes)
                  + f" {fmt(max(startup[fork])):>12}")
        gaps = {m: abs(statistics.mean(peaks[True][m]) - statistics.mean(peaks[False][m]))
                for m in sizes}
        gap_startup = abs(max(startup[True]) - max(startup[False]))
        shown = ", ".join(f"{m}: {fmt(g)} MB" for m, g in gaps.items())
        print(f"\nstep peaks forked vs fresh: {shown}; start-up {fmt(gap_startup)} MB "
              f"(agreement within {AGREE_MB:g} MB)")
        ratio = statistics.median(cpu[True]) / statistics.median(cpu[False])
        verdict("forked / fresh probes' CPU", ratio, "<=", TARGET,
                also=[(f"step peak at {m} within {AGREE_MB:g} MB", g <= AGREE_MB)
                      for m, g in gaps.items()]
                + [(f"start-up peak within {AGREE_MB:g} MB", gap_startup <= AGREE_MB)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
