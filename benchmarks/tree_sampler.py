"""What the job's memory sampler costs the device: CPU of ``TreePeak``'s thread per second of a
fine-tune, beside the sampler as it was (the tree walked and every ``/proc/PID/status`` parsed
at each 10 ms sample).

The tree has a job's shape: this process with four idle threads (the worker's) and two torch
children with four threads each (a step's child and a probe). Both samplers run for
``--seconds`` each, one after the other, on the same tree; the PSS reads are the same in both
and timed apart (one read of the tree's ``smaps_rollup`` files, times the reads a second).

Target: the RSS sampling at most half the baseline's CPU. Then the sampler whole, as a job runs
it: the RSS sampling with its PSS reads, which back off to one every 2 s while the tree holds
still (no target: the figure beside the two above).

Then a job's children one after the other, as its worker starts them: a fine-tune that holds
``--big-mb`` and leaves, then ``--children`` smaller torch children (a stage, a health check:
each imports torch, a rise of ~1 MB every sample). The sampler reads PSS at each new high of
the RSS; a read while the tree's RSS is under the PSS peak already seen cannot raise it and is
skipped. Reads and the sampler's CPU, the same tree sampled with that skip and without it.
Target: at most half the reads.

    python benchmarks/tree_sampler.py [--seconds 10] [--children 3] [--big-mb 300]
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


SMALL = "import time, torch; torch.nn.Linear(64, 10); time.sleep(0.3)"


def children_in_turn(big_mb: int, children: int, skip: bool) -> tuple[int, float, float]:
    """One job's children sampled: (PSS reads, sampler CPU seconds, peak MB)."""
    big = (f"import time, torch; x = torch.ones({big_mb} << 18); time.sleep(0.3)")
    script = ("import subprocess, sys\n"
              + "\n".join(f"subprocess.run([sys.executable, '-c', {c!r}])"
                          for c in [big] + [SMALL] * children))
    old, proctree.STATM_SLACK_MB = proctree.STATM_SLACK_MB, (
        proctree.STATM_SLACK_MB if skip else float("inf"))
    try:
        c0 = time.process_time()  # this process only samples while the tree runs
        p = subprocess.Popen([sys.executable, "-c", script])
        with proctree.TreePeak(root=p.pid) as peak:
            p.wait()
        return peak.pss_reads, time.process_time() - c0, peak.peak_mb
    finally:
        proctree.STATM_SLACK_MB = old


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="each sampler's run")
    ap.add_argument("--children", type=int, default=3,
                    help="torch children after the big one (a job's stage, health, ...)")
    ap.add_argument("--big-mb", type=int, default=300, help="what the first child holds, MB")
    args = parse_args(ap, quick={"seconds": 1.0, "children": 1, "big_mb": 100})
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
        # And whole, as a job runs it: the RSS sampling with the PSS reads, which back off
        # while this tree holds still.
        whole_peak = proctree.TreePeak(interval_s=0.01)
        whole = cpu_per_s(whole_peak._thread, whole_peak._stop, args.seconds)
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
    print(f"TreePeak whole (PSS reads backing off to one every {proctree.PSS_EVERY_MAX_S:g} s "
          f"while the PSS holds still): {100 * whole:.2f}% of a core, "
          f"{whole_peak.pss_reads} PSS reads in {args.seconds:g} s")
    turns = {skip: children_in_turn(args.big_mb, args.children, skip) for skip in (False, True)}
    (r0, c0, p0), (r1, c1, p1) = turns[False], turns[True]
    print(f"a {args.big_mb} MB child, then {args.children} torch children, one at a time:")
    print(f"  PSS read at every new RSS high:      {r0} reads, {c0:.3f} CPU s, peak {p0:.0f} MB")
    print(f"  none while RSS is under the PSS peak: {r1} reads, {c1:.3f} CPU s, peak {p1:.0f} MB")
    print(cpu_line())
    reads = r1 / max(r0, 1)
    verdict("TreePeak RSS sampling CPU / baseline", ratio, "<=", TARGET,
            also=[(f"PSS reads of a job's children in turn {reads:.2f}x <= 0.5x",
                   reads <= 0.5)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
