"""Take a fine-tune process's cold library pages out of its resident set after start-up.

The fine-tune's memory budget is counted in resident memory (the whole process tree's RSS,
from /proc), and RSS counts every page of a shared library the process has touched since it
started. Importing torch touches ~75 MB of libtorch's code and read-only data that runs once
(operator registration, static initialisers) and ~15 MB more when the first optimizer pulls
in ``torch._dynamo``; the training step itself needs ~25 MB of it. How much of a library a
fault maps also varies with the page cache (a freshly installed venv mapped ~60 MB more), which
made the planner's fixed cost move between hosts by more than the margin a 450 MB budget has.

``drop_cold_pages`` unmaps, from this process only, every read-only file-backed mapping that
holds no private page (``madvise(MADV_DONTNEED)``): the page cache keeps the pages, so one the
training step needs comes back on a minor fault, with no disk read, and what never runs again
stays out of the process. Writable mappings and any mapping with an anonymous (copy-on-write)
page — relocated data, patched code — are left alone: dropping those would lose their
contents; so are device mappings (a GPU driver's, flagged ``io``/``pf`` in smaps), locked and
huge-page ones. Unlike ``MADV_PAGEOUT`` this does not evict the page cache, so it works the same
when another torch process maps the same library (the two budgets of a test run side by side).

Each dropped mapping is also switched to one-page faults (``agent.finetune.page_faults``),
so what comes back is the pages the step touches, not the large folios around them, however
the library got into the page cache.

The memory probes and the fine-tune call it at the same two points (after the model is
loaded, after the trainer, and so its optimizer, is built), so the plan predicts the process
it plans for. Linux only; elsewhere, or if /proc cannot be read, it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import re
import sys
from dataclasses import dataclass

from agent.finetune.page_faults import single_page_faults

log = logging.getLogger(__name__)

MADV_DONTNEED = 4  # the same value on every Linux architecture torch runs on
# VmFlags of mappings that are not plain page-cache pages: I/O or raw-PFN (device memory),
# locked, hugetlbfs, excluded from core dumps (what drivers set on their mappings).
_KEEP_FLAGS = frozenset({"io", "pf", "lo", "ht", "dd"})
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")


@dataclass
class Mapping:
    start: int
    end: int
    perms: str
    path: str
    rss_kb: int = 0
    anonymous_kb: int = 0
    flags: frozenset[str] = frozenset()

    @property
    def droppable(self) -> bool:
        """Read-only, backed by a regular file, every resident page a clean page-cache page."""
        return (self.path.startswith("/") and not self.path.startswith("/dev/")
                and "w" not in self.perms and self.anonymous_kb == 0 and self.rss_kb > 0
                and not self.flags & _KEEP_FLAGS)


def parse_smaps(text: str) -> list[Mapping]:
    maps: list[Mapping] = []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            maps.append(Mapping(int(m[1], 16), int(m[2], 16), m[3], m[4]))
        elif maps and line.startswith("Rss:"):
            maps[-1].rss_kb = int(line.split()[1])
        elif maps and line.startswith("Anonymous:"):
            maps[-1].anonymous_kb = int(line.split()[1])
        elif maps and line.startswith("VmFlags:"):
            maps[-1].flags = frozenset(line.split()[1:])
    return maps


def drop_cold_pages() -> float:
    """Unmap this process's clean read-only file pages; return the MB taken out of its RSS
    (0.0 where there is nothing to do or no way to do it)."""
    if not sys.platform.startswith("linux"):
        return 0.0
    try:
        with open("/proc/self/smaps") as f:
            maps = parse_smaps(f.read())
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0.0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    dropped_kb = registered = 0
    for m in maps:
        if not m.droppable:
            continue
        if "uw" not in m.flags:  # "uw": registered at an earlier drop
            registered += single_page_faults.register(m.start, m.end)
        if madvise(m.start, m.end - m.start, MADV_DONTNEED) == 0:
            dropped_kb += m.rss_kb
    log.debug("dropped %.1f MB of cold library pages; %d mappings now fault one page at a "
              "time", dropped_kb / 1024, registered)
    return dropped_kb / 1024
