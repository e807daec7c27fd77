"""registry.lifetime: a helper process dies with its parent, kill -9 included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The parent starts a child that ties itself to it and prints its pid, then sleeps; the test
# SIGKILLs the parent (no handler runs) and the child must be gone.
PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import sys, time; sys.path.insert(0, {str(REPO)!r}); "
    "from registry.lifetime import die_with_parent; die_with_parent(); "
    "print('tied', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "tied"
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its parent"
