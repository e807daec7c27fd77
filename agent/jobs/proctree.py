"""Memory of a whole process tree, sampled from /proc: the job's real footprint.

The budget covers the job process, its probe subprocesses and each step's child together;
``ru_maxrss`` of one process misses the others, so a thread sums the tree every
``interval_s`` and keeps the peak. Summed as PSS (``/proc/PID/smaps_rollup``), the way the
kernel shares the charge of a page among the processes that map it: summed VmRSS counts the
shared library pages (torch, onnxruntime: ~100 MB) once per process, over-stating a tree of
two torch processes. Where smaps_rollup cannot be read (an old kernel, another user's
process) VmRSS stands in. Torch-free and cheap (a few /proc reads per sample).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_PROC = Path("/proc")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    task_dir = _PROC / str(pid) / "task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return kids
    for tid in tids:
        try:
            kids += [int(x) for x in (task_dir / tid / "children").read_text().split()]
        except OSError:
            continue
    return kids


def tree_pids(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += _children(pid)
    return seen


def rss_mb(pid: int) -> float:
    try:
        for line in (_PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pss_mb(pid: int) -> float:
    """The process's proportional set size in MiB (VmRSS where smaps_rollup is unreadable)."""
    try:
        for line in (_PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return rss_mb(pid)


def tree_pss_mb(root: int | None = None) -> float:
    """Summed PSS of ``root`` (default: this process) and all its descendants, in MiB."""
    return sum(pss_mb(p) for p in tree_pids(os.getpid() if root is None else root))


def tree_rss_mb(root: int | None = None) -> float:
    """Summed RSS of ``root`` (default: this process) and all its descendants, in MiB."""
    return sum(rss_mb(p) for p in tree_pids(os.getpid() if root is None else root))


PSS_EVERY_S = 0.25
"""How often PSS is read when the tree's RSS is not at a new high: smaps_rollup walks every
mapping (~5 ms for a torch process), VmRSS is one line (~0.05 ms)."""

MEASURE = ("PSS of the job's process tree (/proc/PID/smaps_rollup), read at each new high of "
           "its RSS (sampled every 10 ms; the high restarts when a process joins or leaves "
           "the tree) and every 0.25 s")
"""How the job's reported peaks are measured (the report says so)."""


class TreePeak:
    """Samples the tree in a daemon thread; ``peak_mb`` is the highest summed PSS seen.

    The tree's RSS (cheap) is sampled every ``interval_s``; its PSS (the figure reported, but
    ~100x dearer to read) each time the RSS passes its previous high by 1 MB, and at least
    every :data:`PSS_EVERY_S`. The high restarts whenever a process joins or leaves the tree:
    summed RSS counts the shared library pages once per process, so a high set while two
    torch processes overlapped hid the later PSS peak of one alone (a job's report 23 MB
    under an outside 10 ms sampler). Within one set of processes a new PSS peak comes with a
    new RSS high, which triggers a read. The sampler so costs a few percent of a core instead
    of most of one, where the fine-tune needs it."""

    def __init__(self, root: int | None = None, interval_s: float = 0.01) -> None:
        self.root = os.getpid() if root is None else root
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self.rss_peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-pss", daemon=True)

    def _run(self) -> None:
        next_pss, members, high = 0.0, frozenset[int](), 0.0
        while not self._stop.is_set():
            pids = tree_pids(self.root)
            rss = sum(rss_mb(p) for p in pids)
            if frozenset(pids) != members:  # sharing changed: an old high means nothing now
                members, high = frozenset(pids), 0.0
            now = time.monotonic()
            if rss > high + 1.0 or now >= next_pss:
                self.peak_mb = max(self.peak_mb, sum(pss_mb(p) for p in pids))
                next_pss = now + PSS_EVERY_S
            high = max(high, rss)
            self.rss_peak_mb = max(self.rss_peak_mb, rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> TreePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, tree_pss_mb(self.root))
