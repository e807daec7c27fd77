"""tests/support/lanes.py: under xdist the last test process runs the waiting files and
nothing else; the others run the rest, and take the waiting files that have not started once
the rest is done; with fewer than three processes every process takes every file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CONFTEST = '''
from tests.support.lanes import WaitingLaneScheduling

WAITING = [f"test_wait{i}.py" for i in range(3)]

def pytest_xdist_make_scheduler(config, log):
    return WaitingLaneScheduling(config, log, waiting=WAITING)
'''

# Each test writes the process that ran it; a waiting file sleeps, as such files do, so the
# busy ones are all handed out while the first waiting files run.
_TEST = '''
import json, os, time
from pathlib import Path

def test_{n}():
    time.sleep({sleep})
    out = Path(os.environ["LANES_OUT"]) / "{name}-{n}.json"
    out.write_text(json.dumps({{"file": "{name}", "worker": os.environ["PYTEST_XDIST_WORKER"],
                               "t": time.monotonic()}}))
'''


def _run(tmp_path: Path, processes: int, waiting: int, busy: int, wait_s: float,
         busy_s: float = 0.01) -> list[dict[str, object]]:
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    (suite / "conftest.py").write_text(_CONFTEST)
    for i in range(waiting):
        (suite / f"test_wait{i}.py").write_text(
            "".join(_TEST.format(n=n, sleep=wait_s, name=f"test_wait{i}.py") for n in range(2)))
    for i in range(busy):
        (suite / f"test_busy{i:02d}.py").write_text(
            "".join(_TEST.format(n=n, sleep=busy_s, name=f"test_busy{i:02d}.py")
                    for n in range(2)))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-n", str(processes), "--dist", "loadfile", "--rootdir", str(suite),
                        str(suite)],
                       cwd=suite, env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"],
                                       "LANES_OUT": str(out)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    ran = [json.loads(f.read_text()) for f in out.iterdir()]
    assert len(ran) == 2 * (waiting + busy), p.stdout  # every test once
    return ran


def _workers(ran: list[dict[str, object]], kind: str) -> set[object]:
    return {r["worker"] for r in ran if str(r["file"]).startswith(kind)}


def test_the_last_process_runs_only_the_waiting_files(tmp_path: Path) -> None:
    ran = _run(tmp_path, processes=4, waiting=3, busy=12, wait_s=0.3)
    assert _workers(ran, "test_busy") <= {"gw0", "gw1", "gw2"}, ran
    assert "gw3" in _workers(ran, "test_wait"), ran
    # A file's tests stay together in one process, as with --dist loadfile.
    by_file: dict[object, set[object]] = {}
    for r in ran:
        by_file.setdefault(r["file"], set()).add(r["worker"])
    assert all(len(w) == 1 for w in by_file.values()), by_file


def test_every_busy_process_keeps_working_after_the_lane_has_stopped(tmp_path: Path) -> None:
    # One short waiting file: the lane stops at once, long before the 24 busy files (0.3 s
    # each) are done. The three others share them to the end; none takes the lane's place and
    # stops after the file it holds.
    ran = _run(tmp_path, processes=4, waiting=1, busy=24, wait_s=0.01, busy_s=0.15)
    files: dict[object, set[object]] = {}
    for r in ran:
        if str(r["file"]).startswith("test_busy"):
            files.setdefault(r["worker"], set()).add(r["file"])
    assert set(files) == {"gw0", "gw1", "gw2"}, files
    assert all(len(f) >= 5 for f in files.values()), {w: len(f) for w, f in files.items()}


def test_the_busy_processes_take_the_waiting_files_left_when_theirs_are_done(
    tmp_path: Path,
) -> None:
    # Four waiting files of 2 x 0.5 s each and little else: the lane cannot run them all before
    # the busy processes are done with theirs, so those take the last ones.
    ran = _run(tmp_path, processes=3, waiting=4, busy=2, wait_s=0.5)
    assert "gw2" in _workers(ran, "test_wait"), ran
    assert _workers(ran, "test_wait") & {"gw0", "gw1"}, ran
    assert _workers(ran, "test_busy") <= {"gw0", "gw1"}, ran


def test_with_fewer_than_three_processes_every_process_takes_every_kind(tmp_path: Path) -> None:
    ran = _run(tmp_path, processes=2, waiting=2, busy=8, wait_s=0.5)
    # No lane: the second process is not kept for the waiting files.
    assert _workers(ran, "test_busy") == {"gw0", "gw1"}, ran
