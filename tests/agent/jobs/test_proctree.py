"""The job's process-tree sampler: a PSS peak after a process left the tree is seen, and a
tree that holds still is read less often without missing what only a PSS read shows."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from agent.jobs.proctree import TreePeak

# The parent and a forked child both touch 120 MB of shared anonymous memory (summed RSS 240
# MB, PSS 120 MB); the child exits; then the parent holds 80 MB more of its own for two of
# the sampler's samples (the test tells it when: a fixed 0.05 s once saw none on a loaded
# host): PSS 200 MB, its peak, while the summed RSS (200 MB) stays under the high of the pair.
# A sampler that reads PSS only above that RSS high sees it only if its 0.25 s tick falls
# there.
SCRIPT = """
import mmap, os, sys, time
shared = mmap.mmap(-1, 120 << 20, flags=mmap.MAP_SHARED)
chunk = b"x" * (1 << 20)
for i in range(120):  # no 120 MB temporary: that alone would be the peak
    shared[i << 20:(i + 1) << 20] = chunk
pid = os.fork()
if pid == 0:
    for i in range(0, 120 << 20, 4096):
        shared[i]
    time.sleep(0.5)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.3)
own = bytearray(80 << 20)
own[::4096] = b"x" * len(range(0, 80 << 20, 4096))  # every page touched, no temporary copy
print("holding", flush=True)
sys.stdin.readline()
del own
time.sleep(0.3)
"""


def test_the_pss_peak_after_a_process_left_is_seen() -> None:
    seen = []
    for _ in range(3):  # a 0.25 s tick lands in two 10 ms samples' peak in few runs
        p = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdin is not None and p.stdout is not None
        with TreePeak(root=p.pid) as peak:
            assert p.stdout.readline().strip() == "holding"
            start, deadline = peak.samples, time.monotonic() + 30
            while peak.samples < start + 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(30)
            time.sleep(0.05)
        seen.append(peak.peak_mb)
    # PSS: ~120 MB shared + ~80 MB own + the interpreter; the pair alone never passed ~130.
    assert min(seen) >= 190, seen


def test_rss_from_statm_is_the_status_files_vmrss() -> None:
    # statm counts pages: the page size (4 or 64 KiB on a Jetson kernel) must be the kernel's.
    from pathlib import Path

    from agent.jobs.proctree import rss_mb

    grow = bytearray(64 << 20)
    grow[::4096] = b"x" * len(range(0, 64 << 20, 4096))
    status = Path("/proc/self/status").read_text()
    vm_rss = next(int(line.split()[1]) for line in status.splitlines()
                  if line.startswith("VmRSS:")) / 1024
    assert abs(rss_mb(os.getpid()) - vm_rss) < 2.0, (rss_mb(os.getpid()), vm_rss)
    assert rss_mb(2**22 + 12345) == 0.0  # no such process


def test_a_process_that_joins_late_is_counted() -> None:
    # The tree is walked every few samples, not every one: a child started 0.3 s in that
    # holds 150 MB for 0.3 s is in the peak.
    late = ("import subprocess, sys, time; time.sleep(0.3); subprocess.run([sys.executable, '-c',"
            " 'b = bytearray(150 << 20); b[::4096] = bytes(len(range(0, 150 << 20, 4096)));"
            " import time; time.sleep(0.3)'])")
    p = subprocess.Popen([sys.executable, "-c", late])
    with TreePeak(root=p.pid) as peak:
        p.wait(30)
    assert peak.peak_mb >= 150, peak.peak_mb


def test_no_pss_read_while_the_tree_holds_less_than_its_peak() -> None:
    # A child holds 200 MB for 0.5 s and leaves; the parent then idles at ~10 MB for 1.5 s.
    # PSS never exceeds RSS, so no read of that idle tree could raise the 200 MB peak: none is
    # made (the 0.25 s reads alone would have made five or six).
    from agent.jobs.proctree import tree_pids

    big = ("import time; b = bytearray(200 << 20); b[::4096] = bytes(len(range(0, 200 << 20,"
           " 4096))); time.sleep(0.5)")  # held past a 0.25 s read however late the sampler is
    script = (f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {big!r}]);"
              " time.sleep(1.5)")
    p = subprocess.Popen([sys.executable, "-c", script])
    with TreePeak(root=p.pid) as peak:
        deadline = time.monotonic() + 30
        while len(tree_pids(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        while len(tree_pids(p.pid)) > 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.1)  # a read begun while the child was still there has ended
        reads = peak.pss_reads
        p.wait(30)
        assert peak.pss_reads == reads, (reads, peak.pss_reads)
    assert peak.peak_mb >= 200 and reads >= 1, (peak.peak_mb, reads)


READER = ("import mmap, sys, time; f = open(sys.argv[1], 'rb'); "
          "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
          "sum(m[i] for i in range(0, len(m), 4096)); print('mapped', flush=True); "
          "time.sleep(float(sys.argv[2]))")
"""Maps a file, touches every page of it, says so, holds it for argv[2] seconds."""


def test_a_tree_that_holds_still_is_read_less_often_yet_a_pss_rise_without_rss_is_seen(
        tmp_path: Path) -> None:
    # The tree maps 100 MB of a file that an outside process maps too: PSS charges it half of
    # those pages. The outsider leaves: the tree's PSS rises by ~50 MB and its RSS does not
    # move, so only the periodic read can see it, however far it has backed off.
    from agent.jobs.proctree import PSS_EVERY_MAX_S, PSS_EVERY_S

    data = tmp_path / "shared.bin"
    data.write_bytes(b"x" * (100 << 20))
    outsider = subprocess.Popen([sys.executable, "-c", READER, str(data), "60"],
                                stdout=subprocess.PIPE, text=True)
    tree = subprocess.Popen([sys.executable, "-c", READER, str(data), "60"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert outsider.stdout is not None and tree.stdout is not None
        assert outsider.stdout.readline() == tree.stdout.readline() == "mapped\n"
        with TreePeak(root=tree.pid) as peak:
            held_s = 4 * PSS_EVERY_MAX_S
            time.sleep(held_s)
            shared = peak.peak_mb
            # Holding still, the reads backed off (0, 0.25, 0.75, 1.75, 3.75 s, ...: about 7):
            # fixed at PSS_EVERY_S they would be ~32.
            assert 2 <= peak.pss_reads < held_s / PSS_EVERY_S / 3, peak.pss_reads
            outsider.kill()
            outsider.wait(30)
            time.sleep(PSS_EVERY_MAX_S + 0.5)  # the next read, however late it falls
            alone = peak.peak_mb
    finally:
        for p in (outsider, tree):
            p.kill()
            p.wait(30)
    assert alone >= shared + 40, (shared, alone)
