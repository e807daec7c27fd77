"""The job's process-tree sampler: a PSS peak after a process left the tree is seen."""

from __future__ import annotations

import subprocess
import sys
import time

from agent.jobs.proctree import TreePeak

# The parent and a forked child both touch 120 MB of shared anonymous memory (summed RSS 240
# MB, PSS 120 MB); the child exits; then the parent holds 80 MB more of its own for 0.05 s:
# PSS 200 MB, its peak, while the summed RSS (200 MB) stays under the high of the pair. A
# sampler that reads PSS only above that RSS high sees it only if its 0.25 s tick falls there.
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
time.sleep(0.05)
del own
time.sleep(0.3)
"""


def test_the_pss_peak_after_a_process_left_is_seen() -> None:
    seen = []
    for _ in range(3):  # a 0.25 s tick lands in the 0.05 s peak in one run of five
        p = subprocess.Popen([sys.executable, "-c", SCRIPT])
        with TreePeak(root=p.pid) as peak:
            p.wait(30)
            time.sleep(0.05)
        seen.append(peak.peak_mb)
    # PSS: ~120 MB shared + ~80 MB own + the interpreter; the pair alone never passed ~130.
    assert min(seen) >= 190, seen
