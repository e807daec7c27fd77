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

import itertools
import os
import threading
import time

_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
"""statm counts pages; a Jetson kernel may use 4 KiB or 64 KiB ones."""


def _read(path: str) -> bytes:
    """A whole /proc file with two syscalls (and no pathlib or text decoding): the sampler
    reads a few dozen of them a second."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = [os.read(fd, 65536)]
        while len(chunks[-1]) == 65536:
            chunks.append(os.read(fd, 65536))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _children(pid: int) -> list[int]:
    """Children of every thread of ``pid``: a child started from a thread other than the
    main one is listed under that thread only."""
    kids: list[int] = []
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return kids
    for tid in tids:
        try:
            kids += [int(x) for x in _read(f"{task_dir}/{tid}/children").split()]
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


def _rss_or_none(pid: int) -> float | None:
    """VmRSS in MiB from /proc/PID/statm (its second field: the same anon + file + shmem
    pages, a quarter of the cost of parsing ``status``); None once the process is gone."""
    try:
        return int(_read(f"/proc/{pid}/statm").split()[1]) * _PAGE_MB
    except (OSError, IndexError, ValueError):
        return None


def _summed_rss(pids: list[int]) -> float | None:
    """The processes' summed RSS in MiB; None when one of them has left."""
    total = 0.0
    for pid in pids:
        rss = _rss_or_none(pid)
        if rss is None:
            return None
        total += rss
    return total


def rss_mb(pid: int) -> float:
    """The process's resident set in MiB (0 once it is gone)."""
    rss = _rss_or_none(pid)
    return 0.0 if rss is None else rss


def pss_mb(pid: int) -> float:
    """The process's proportional set size in MiB (VmRSS where smaps_rollup is unreadable)."""
    try:
        for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
            if line.startswith(b"Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss_mb(pid)


def tree_pss_mb(root: int | None = None) -> float:
    """Summed PSS of ``root`` (default: this process) and all its descendants, in MiB."""
    return sum(pss_mb(p) for p in tree_pids(os.getpid() if root is None else root))


def tree_rss_mb(root: int | None = None) -> float:
    """Summed RSS of ``root`` (default: this process) and all its descendants, in MiB."""
    return sum(rss_mb(p) for p in tree_pids(os.getpid() if root is None else root))


WALK_EVERY = 5
"""Samples between two walks of the tree (each reads every thread's children file): a
process that joins is seen within 5 samples (50 ms; a Python child spends longer than that
starting), one that leaves at the next sample (its statm is gone)."""

PSS_EVERY_S = 0.25
"""How often PSS is read when the tree's RSS is not at a new high: smaps_rollup walks every
mapping (~5 ms for a torch process), VmRSS is one line (~0.05 ms). The period doubles after
each such read that found the PSS where the last one left it, up to :data:`PSS_EVERY_MAX_S`,
and starts again from this one whenever the tree changes, its RSS sets a new high or a read
finds a rise."""
PSS_EVERY_MAX_S = 2.0
"""The longest wait between two PSS reads of a tree that holds still. Without an RSS rise
only another process's leaving can raise the tree's PSS (the pages it shared are charged to
the tree alone), and that rise stays: it is read within this long. A fine-tune's minutes at
a steady RSS cost a read every 2 s instead of four a second (their 8% of a core, with two
torch processes in the tree, ~1%: ``python benchmarks/tree_sampler.py``)."""
PSS_STILL_MB = 2.0
"""How far two reads' PSS may differ for the tree to count as holding still: the tree's share
of the libraries it maps moves by a fraction of a MB as other processes that map them come and
go. A slow climb of less than this a read is still read, and its peak kept, every 2 s."""

_CPUS = os.cpu_count() or 1
STATM_SLACK_MB = 4.0 + _CPUS * max(32, 2 * _CPUS) * _PAGE_MB
"""How far statm's resident count may trail the pages a process holds: the kernel keeps it in
per-CPU counters read without summing them (up to max(32, 2 x CPUs) pages per CPU: 0.25 MB on
2 cores, 1.5 MB on a 12-core Orin), or, on kernels before 6.2, in per-thread caches synced every
64 faults; 4 MB on top covers the threads."""

MEASURE = ("PSS of the job's process tree (/proc/PID/smaps_rollup), read at each new high of "
           "its RSS (sampled every 10 ms; the high restarts when a process joins or leaves "
           "the tree) and every 0.25 s (up to 2 s while the PSS holds still), whenever that "
           "RSS could hold a new PSS peak")
"""How the job's reported peaks are measured (the report says so)."""


class TreePeak:
    """Samples the tree in a daemon thread; ``peak_mb`` is the highest summed PSS seen.

    The tree's RSS (cheap) is sampled every ``interval_s``; its PSS (the figure reported, but
    ~100x dearer to read) each time the RSS passes its previous high by 1 MB, and at least
    every :data:`PSS_EVERY_S` (backing off to :data:`PSS_EVERY_MAX_S` while the PSS holds
    still); never while the tree's RSS is under the PSS peak already seen
    (less :data:`STATM_SLACK_MB`): a process's PSS never exceeds its RSS, so such a read could
    not raise the peak. That skips most of the reads of a job's later children, each of which
    starts by importing torch (a rise of ~1 MB each 10 ms sample for a second or more, every
    sample a new high) while the fine-tune's larger peak stands. The high restarts whenever a
    process joins or leaves the tree:
    summed RSS counts the shared library pages once per process, so a high set while two
    torch processes overlapped hid the later PSS peak of one alone (a job's report 23 MB
    under an outside 10 ms sampler). Within one set of processes a new PSS peak comes with a
    new RSS high, which triggers a read. The tree is walked every :data:`WALK_EVERY` samples
    (and at once when a process left), each sample reads one statm line per process: the RSS
    sampling costs 1.3% of a core where walking and parsing ``status`` at every sample cost
    5.7%, beside the 3% of the PSS reads (a job process and two idle torch children: ``python
    benchmarks/tree_sampler.py``). A few percent of a core instead of most of one, where the
    fine-tune needs it."""

    def __init__(self, root: int | None = None, interval_s: float = 0.01) -> None:
        self.root = os.getpid() if root is None else root
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self.rss_peak_mb = 0.0
        self.pss_reads = 0
        """Reads of the whole tree's PSS so far (the sampler's dearest work)."""
        self.samples = 0
        """Samples of the tree's RSS so far (one a loop)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-pss", daemon=True)

    def _run(self) -> None:
        next_pss, members, high = 0.0, frozenset[int](), 0.0
        every, last_pss = PSS_EVERY_S, -1.0
        pids: list[int] = []
        for n in itertools.count():
            if self._stop.is_set():
                break
            rss = None if n % WALK_EVERY == 0 else _summed_rss(pids)
            if rss is None:  # time to walk, or a process left
                pids = tree_pids(self.root)
                rss = sum(rss_mb(p) for p in pids)
                if frozenset(pids) != members:  # sharing changed: an old high means nothing
                    members, high, every = frozenset(pids), 0.0, PSS_EVERY_S
            now = time.monotonic()
            rising = rss > high + 1.0
            if (rising or now >= next_pss) and rss + STATM_SLACK_MB > self.peak_mb:
                pss = sum(pss_mb(p) for p in pids)
                self.peak_mb = max(self.peak_mb, pss)
                self.pss_reads += 1
                still = not rising and abs(pss - last_pss) <= PSS_STILL_MB
                every = min(2 * every, PSS_EVERY_MAX_S) if still else PSS_EVERY_S
                last_pss, next_pss = pss, now + every
            high = max(high, rss)
            self.rss_peak_mb = max(self.rss_peak_mb, rss)
            self.samples += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> TreePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, tree_pss_mb(self.root))
