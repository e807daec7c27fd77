"""What the ``--quick`` tests of benchmarks/ share: which scripts there are, which file runs
each, and the run itself.

Every ``benchmarks/*.py`` is found by a glob, so a new script cannot be missed: it runs in
``test_quick_fleet.py`` (the light file) unless a heavier group below names it, or it is
listed in :data:`NOT_BENCHMARKS` with the reason. The scripts are split over three files so
that ``pytest-xdist --dist loadfile`` can give them to different workers.

A quick run asserts nothing about the figures (machines differ): exit 0, and the verdict line
(``benchmarks.harness.VERDICT``) as the last line of its output.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness import VERDICT
from tests.support.mosquitto import have_mosquitto

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

NOT_BENCHMARKS = {
    "detection_device.py": "benchmarks/detection.py's device half (a detector's whole device "
                           "job): no main",
    "fleet_tier.py": "benchmarks/fleet.py's brokers, simulated devices and counters: no main",
    "harness.py": "--quick and the verdict line every script shares: no main",
    "oip_threaded.py": "the former threaded agentctl serve server, http_server.py's baseline: "
                       "no main",
}
DEVICE_JOB = ("device_job.py", "job_budget.py", "detection.py", "detection_int8.py")
"""Whole device jobs (worker, probes, fine-tune, INT8 export, health): the heaviest."""
TRAINING = ("runtime.py", "upstream.py", "finetune.py", "export.py", "export_time.py",
            "trainer_overhead.py", "tune_backends.py", "probes.py")
"""Training, probing and exporting in fresh torch processes."""
NEEDS = {
    "agent.py": ("mosquitto", have_mosquitto),
    "bridge_acl.py": ("mosquitto", have_mosquitto),
    "dashboard.py": ("mosquitto and chromium", lambda: have_mosquitto()
                     and Path("/usr/bin/chromium").exists()),
    "fleet.py": ("mosquitto", have_mosquitto),
    "metrics.py": ("mosquitto", have_mosquitto),
    "sync.py": ("curl", lambda: shutil.which("curl") is not None),
}
"""Script -> (what it needs on the host, whether the host has it): skipped without it."""
TIMEOUT_S = 540


def scripts() -> list[str]:
    """Every benchmark script (file name) under benchmarks/."""
    return sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in NOT_BENCHMARKS)


def light() -> list[str]:
    """The scripts no heavier group names: test_quick_fleet.py runs these."""
    return [s for s in scripts() if s not in DEVICE_JOB + TRAINING]


def extra_args(script: str, tmp_path: Path) -> list[str]:
    """Where a script writes files of its own: under the test's tmp_path."""
    if script in ("governor.py", "finetune.py"):
        return ["--plot", str(tmp_path / "governor.png")]
    if script in ("federated_protocol.py", "fleet_pays.py"):
        return ["--plot", str(tmp_path / "curves.png"), "--json", str(tmp_path / "fp.json")]
    return []


def run_quick(script: str, tmp_path: Path, env: dict[str, str]) -> str:
    """``python benchmarks/SCRIPT --quick`` from the repository root; its output, once it
    exited 0 and ended with the verdict line. The time it took goes to the test's output."""
    need = NEEDS.get(script)
    if need is not None and not need[1]():
        pytest.skip(f"{script} needs {need[0]} (make services)")
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *extra_args(script, tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    out = done.stdout
    tail = (out + done.stderr)[-4000:]
    assert done.returncode == 0, f"{script} --quick exited {done.returncode}:\n{tail}"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines, f"{script} --quick printed nothing:\n{tail}"
    assert VERDICT.match(lines[-1]), f"{script}: the last line is no verdict:\n{tail}"
    print(f"{script} --quick: {time.monotonic() - t0:.1f} s; {lines[-1]}")
    return out


def has_main(path: Path) -> bool:
    return re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M) is not None
