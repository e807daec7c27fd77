"""What the job's memory sampler costs the device: CPU of ``TreePeak``'s thread per second of a
fine-tune, beside the sampler as it was (the tree walked and every ``/proc/PID/status`` parsed
at each 10 ms sample).

The tree has a job's shape: this process with four idle threads (the worker's) and two torch
children with four threads each (a step's child and a probe). Both samplers run for
``--seconds`` each, one after the other, on the same tree; the PSS reads are the same in both
and timed apart (one read of the tree's ``smaps_rollup`` files, times the reads a second).

Target: the RSS sampling at most half the baseline's CPU.

    python benchmarks/tree_sampler.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

import agent.jobs.proctree as proctree  # noqa: E402
from benchmarks.harness import cpu_line, parse_args, verdict  # noqa: E402

CHILD = ("import time, torch; torch.set_num_threads(4); "
         "torch.ones(512, 512) @ torch.ones(512, 512); time.sleep(600)")
TARGET = 0.5


def _status_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _baseline_walk(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        task = Path(f"/proc/{p}/task")
        try:
            tids = os.listdir(task)
        except OSError:
            continue
        for tid in tids:
            try:
                todo += [int(x) for x in (task / tid / "children").read_text().split()]
            except OSError:
                continue
    return seen


def baseline_sampler(stop: threading.Event, interval_s: float) -> None:
    """The RSS half of the sampler before: a full walk and ``status`` parsed every sample."""
    high = 0.0
    while not stop.is_set():
        high = max(high, sum(_status_rss_mb(p) for p in _baseline_walk(os.getpid())))
        stop.wait(interval_s)


def cpu_per_s(run: threading.Thread, stop: threading.Event, seconds: float) -> float:
    """CPU seconds this process spent per second while ``run`` sampled (the rest sleeps)."""
    c0, t0 = time.process_time(), time.monotonic()
    run.start()
    time.sleep(seconds)
    stop.set()
    run.join()
    return (time.process_time() - c0) / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="each sampler's run")
    args = parse_args(ap, quick={"seconds": 1.0})
    kids = [subprocess.Popen([sys.executable, "-c", CHILD]) for _ in range(2)]
    idle = threading.Event()
    for _ in range(4):
        threading.Thread(target=idle.wait, daemon=True).start()
    try:
        time.sleep(5)  # torch imported in both children
        stop = threading.Event()
        base = cpu_per_s(threading.Thread(target=baseline_sampler, args=(stop, 0.01)), stop,
                         args.seconds)
        # TreePeak's RSS sampling alone: its PSS reads (the same as the baseline's) held off
        old_every, proctree.PSS_EVERY_S = proctree.PSS_EVERY_S, 1e9
        try:
            peak = proctree.TreePeak(interval_s=0.01)
            now = cpu_per_s(peak._thread, peak._stop, args.seconds)
        finally:
            proctree.PSS_EVERY_S = old_every
        c0, reads = time.process_time(), 5
        for _ in range(reads):
            proctree.tree_pss_mb()
        pss_per_s = (time.process_time() - c0) / reads / old_every
    finally:
        idle.set()
        for k in kids:
            k.kill()
            k.wait()
    ratio = now / base
    print(f"tree: this process and {len(kids)} torch children; a sample every 10 ms")
    print(f"baseline (walk + status each sample): {100 * base:.2f}% of a core")
    print(f"TreePeak RSS sampling:                {100 * now:.2f}% of a core")
    print(f"PSS reads every {old_every:g} s (both):        {100 * pss_per_s:.2f}% of a core")
    print(cpu_line())
    verdict("TreePeak RSS sampling CPU / baseline", ratio, "<=", TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
