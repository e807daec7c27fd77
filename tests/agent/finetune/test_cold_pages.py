"""Dropping cold library pages: only clean read-only file pages go, contents never change."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.finetune.cold_pages import drop_cold_pages, parse_smaps

REPO = Path(__file__).resolve().parents[3]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")

# From /proc/self/smaps of a Python 3.11 process with torch imported (fields cut), and the
# shape of a driver's device mapping and of a locked one.
SMAPS = """\
7f3a1c000000-7f3a1f2c4000 r-xp 00a5e000 fe:00 1843377                    /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
Size:              52496 kB
Rss:               61420 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me sd
7f3a1f2c4000-7f3a1f5d0000 r--p 03d22000 fe:00 1843377                    /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
Size:               3120 kB
Rss:                3120 kB
Anonymous:          3120 kB
VmFlags: rd mr mw me ac sd
7f3a1f5d0000-7f3a1f5f0000 rw-p 0402e000 fe:00 1843377                    /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
Size:                128 kB
Rss:                 128 kB
Anonymous:            96 kB
VmFlags: rd wr mr mw me ac sd
5652c5a3e000-5652c8b6a000 rw-p 00000000 00:00 0                          [heap]
Size:              50352 kB
Rss:               50100 kB
Anonymous:         50100 kB
VmFlags: rd wr mr mw me ac sd
7f3a20000000-7f3a20040000 r--s 00000000 fe:00 1900001                    /state/models/a/model.safetensors
Size:                256 kB
Rss:                   0 kB
Anonymous:             0 kB
VmFlags: rd sh mr mw me ms sd
7f3a21000000-7f3a21100000 r--s 00000000 00:06 612                        /dev/nvmap
Size:               1024 kB
Rss:                1024 kB
Anonymous:             0 kB
VmFlags: rd sh mr mw me io pf dd
7f3a22000000-7f3a22100000 r-xp 00000000 fe:00 1900002                    /opt/locked/libx.so
Size:               1024 kB
Rss:                1024 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me lo
"""  # noqa: E501 (the kernel's own column layout)


def test_parse_smaps_picks_only_clean_read_only_file_mappings() -> None:
    maps = parse_smaps(SMAPS)
    assert [(m.perms, m.rss_kb, m.anonymous_kb) for m in maps] == [
        ("r-xp", 61420, 0), ("r--p", 3120, 3120), ("rw-p", 128, 96), ("rw-p", 50100, 50100),
        ("r--s", 0, 0), ("r--s", 1024, 0), ("r-xp", 1024, 0)]
    assert maps[0].path.endswith("libtorch_cpu.so") and maps[3].path == "[heap]"
    assert maps[0].start == 0x7F3A1C000000 and maps[0].end == 0x7F3A1F2C4000
    # Code: dropped. Relocated read-only data (copy-on-write pages), writable data, the heap:
    # kept. A mapping with nothing resident: nothing to drop. A driver's device memory and a
    # locked mapping: kept.
    assert maps[5].flags == {"rd", "sh", "mr", "mw", "me", "io", "pf", "dd"}
    assert [m.droppable for m in maps] == [True, False, False, False, False, False, False]
    maps[5].path = "/opt/x/device.bin"  # not under /dev: its flags alone keep it
    assert not maps[5].droppable


def _rss_kb(start: int) -> tuple[int, int]:
    with open("/proc/self/smaps") as f:
        found = [m for m in parse_smaps(f.read()) if m.start == start]
    assert len(found) == 1
    return found[0].rss_kb, found[0].anonymous_kb


@linux_only
def test_drop_unmaps_clean_pages_and_keeps_every_private_change(tmp_path: Path) -> None:
    size = 64 * mmap.PAGESIZE
    data = os.urandom(size)
    for name in ("clean", "patched", "writable"):
        (tmp_path / name).write_bytes(data)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def mapped(name: str) -> tuple[mmap.mmap, int]:
        """A private mapping of the file, writable for now (ctypes needs a writable buffer
        to give its address)."""
        with open(tmp_path / name, "r+b") as f:
            mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(view)
        del view  # an exported buffer would keep the mmap from closing
        return mm, addr

    def read_only(addr: int) -> None:
        assert libc.mprotect(addr, size, mmap.PROT_READ) == 0, ctypes.get_errno()

    clean, clean_at = mapped("clean")  # never written: read-only file pages, like code
    read_only(clean_at)
    assert clean[:] == data  # every page resident
    # A read-only mapping with one copy-on-write page (what relocated data or patched code
    # looks like): dropping it would bring back the file's bytes.
    patched, patched_at = mapped("patched")
    patched[:5] = b"XXXXX"
    read_only(patched_at)
    assert patched[:] != data  # every page resident
    writable, writable_at = mapped("writable")
    writable[-5:] = b"YYYYY"

    assert _rss_kb(clean_at)[0] == size // 1024
    assert _rss_kb(patched_at)[1] > 0
    dropped = drop_cold_pages()

    assert dropped * 1024 >= size // 1024
    assert _rss_kb(clean_at)[0] == 0  # out of this process...
    assert clean[:] == data  # ...and back, unchanged, on the next read
    assert patched[:5] == b"XXXXX" and patched[5:] == data[5:]
    assert writable[-5:] == b"YYYYY" and writable[:-5] == data[:-5]
    assert _rss_kb(patched_at)[0] == size // 1024 and _rss_kb(writable_at)[0] > 0
    for mm in (clean, patched, writable):
        mm.close()


PROBE = """
import json
import torch
from agent.finetune.cold_pages import drop_cold_pages
def rss():
    return {k: int(v.split()[0]) / 1024 for k, v in
            (line.split(":", 1) for line in open("/proc/self/status"))
            if k in ("VmRSS", "RssFile")}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 10))
opt = torch.optim.AdamW(model.parameters())
x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
def step():
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()
first = step()
before = rss()
dropped = drop_cold_pages()
after = rss()
print(json.dumps({"first": first, "second": step(), "before": before, "after": after,
                  "dropped": dropped}))
"""


@linux_only
def test_a_torch_process_sheds_its_start_up_code_and_still_trains() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # ~90 MB of libtorch's pages are resident after a step; all but a few are dropped.
    assert r["dropped"] > 30, r
    assert r["before"]["VmRSS"] - r["after"]["VmRSS"] > 30, r
    assert r["after"]["RssFile"] < 0.2 * r["before"]["RssFile"], r
    # The same training as a process that kept its pages: the same seed without the drop
    # gives bit-identical losses before and after the point where the pages went.
    ref = subprocess.run(
        [sys.executable, "-c", PROBE.replace("dropped = drop_cold_pages()", "dropped = 0.0")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    plain = json.loads(ref.stdout.strip().splitlines()[-1])
    assert (r["first"], r["second"]) == (plain["first"], plain["second"])


ONE_PAGE = """
import json, mmap, sys
from pathlib import Path
from agent.finetune.cold_pages import drop_cold_pages, parse_smaps
from agent.finetune.page_faults import single_page_faults
path = sys.argv[1]
def kb():
    with open("/proc/self/smaps") as f:
        found = [m for m in parse_smaps(f.read()) if m.path == path]
    assert len(found) == 1, found
    return found[0].rss_kb, "uw" in found[0].flags
with open(path, "rb") as f:
    code = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
code[1 << 20]  # one byte read, as code runs: the kernel maps what it likes around it
plain = kb()
drop_cold_pages()
dropped = kb()
code[3 << 20]
after = kb()
# A private writable mapping registered the same way still takes copy-on-write writes.
with open(path, "rb") as f:
    data = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
import ctypes
view = ctypes.c_char.from_buffer(data)
at = ctypes.addressof(view)
del view
registered = single_page_faults.register(at, at + len(data))
data[5:10] = b"XXXXX"
print(json.dumps({"available": single_page_faults.available, "plain": plain,
                  "dropped": dropped, "after": after, "registered": registered,
                  "written": data[:12].hex(), "file": Path(path).read_bytes()[:12].hex()}))
"""


@linux_only
def test_pages_come_back_one_at_a_time_after_a_drop(tmp_path: Path) -> None:
    """A file written in one piece, as pip writes a library: the page cache may hold it in
    large folios, and a read fault maps 64 KB to a whole folio around the page. Once dropped,
    the mapping faults back exactly the pages that are read."""
    lib = tmp_path / "libbig.so"
    lib.write_bytes(os.urandom(4 << 20))
    out = subprocess.run([sys.executable, "-c", ONE_PAGE, str(lib)], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["available"]:
        pytest.skip("this kernel has no userfaultfd write-protect-async mode (Linux >= 6.7) or "
                    "a seccomp filter refuses userfaultfd: faults keep the kernel's fault-around")
    page_kb = mmap.PAGESIZE // 1024
    assert r["plain"][0] > page_kb and not r["plain"][1], r  # fault-around at work
    assert r["dropped"] == [0, True], r
    assert r["after"] == [page_kb, True], r
    assert r["registered"], r
    original = lib.read_bytes()[:12]
    assert bytes.fromhex(r["written"]) == original[:5] + b"XXXXX" + original[10:12], r
    assert bytes.fromhex(r["file"]) == original, r


FORKED = """
import json, os
from agent.finetune.page_faults import single_page_faults
parent = single_page_faults.available
pid = os.fork()
if pid == 0:
    single_page_faults.available  # a child opens its own descriptor
    os._exit(0 if single_page_faults._pid == os.getpid() else 1)
_, status = os.waitpid(pid, 0)
print(json.dumps({"parent": parent, "child_ok": os.waitstatus_to_exitcode(status) == 0,
                  "parent_kept": single_page_faults._pid == os.getpid()}))
"""


@linux_only
def test_a_forked_child_opens_its_own_userfaultfd() -> None:
    out = subprocess.run([sys.executable, "-c", FORKED], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["child_ok"] and r["parent_kept"], r
