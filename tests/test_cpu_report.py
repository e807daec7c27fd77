"""tests/support/cpu_report.py: the CPU by test file counts the processes a test started and
waited for, and not the time it slept."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_TESTS = '''
import subprocess, sys, time

BUSY = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1: pass"

def test_busy_child():
    subprocess.run([sys.executable, "-c", BUSY], check=True)

def test_idle():
    time.sleep(0.5)
'''


def test_the_summary_counts_a_waited_child_and_not_a_sleep(tmp_path: Path) -> None:
    (tmp_path / "test_two.py").write_text(_TESTS)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "tests.support.cpu_report", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_two.py")],
                       cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                          "CPU_REPORT_JSON": str(tmp_path / "cpu.json")},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "CPU by test file (top 15)" in p.stdout, p.stdout
    row = re.search(r"^\s+(\d+)\s+(\d+)\s+test_two\.py$", p.stdout, re.M)
    assert row is not None, p.stdout
    assert int(row[1]) >= 1 and int(row[2]) >= 1, row[0]  # the child's 1 s of CPU, 1.5 s wall
    total = re.search(r"^all 1 files: (\d+) CPU-s in \d+ s wall", p.stdout, re.M)
    assert total is not None and int(total[1]) < 3, p.stdout  # the sleep is not CPU
    # The same figures per test, written where CPU_REPORT_JSON says.
    figures = json.loads((tmp_path / "cpu.json").read_text())
    busy, idle = (figures["tests"][f"test_two.py::{t}"] for t in ("test_busy_child", "test_idle"))
    assert busy[0] >= 1 > idle[0] and idle[1] >= 0.5, figures["tests"]
    assert figures["files"]["test_two.py"][0] == pytest.approx(busy[0] + idle[0]), figures
    # The file's span in the run: one process (no xdist here), over the child's 1 s and the sleep.
    worker, start, end = figures["spans"]["test_two.py"]
    assert worker == "main" and start >= 0 and end - start >= 1.5, figures["spans"]
