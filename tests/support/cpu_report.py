"""The suite's CPU by test file, printed at the end of every run beside ``--durations``.

``make test`` is CPU-bound on a 2-core host (its test processes and the processes they
start keep both cores 80-90 % busy over the run), so wall time per test says less than where the
CPU goes: a test that waits on a broker holds a process but leaves the core to the others. Each
test's CPU is what its test process used (all its threads) plus every process it started and
waited for (``RUSAGE_CHILDREN``: agents, device jobs, probes, the demo's whole tree), over
setup, call and teardown; a process still running when the test ends is not counted. The
summary sums it per file, with the run's total against the cores the wall time offered.
With ``CPU_REPORT_JSON=FILE`` in the environment every test's and every file's figures are
also written to FILE (``{"tests": {nodeid: [cpu_s, wall_s]}, "files": {...}}``), to sort and
compare runs; ``"spans"`` gives each file's test process and the run's seconds it started and
ended at (the tests' reports as received; where the processes sat idle, and the run's tail).
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

from registry.atomic import write_json_atomic

KEY = "cpu_s"
"""The user property a test's report carries its CPU seconds in (it crosses to the xdist
controller with the report)."""
TOP = 15
_start: pytest.StashKey[float] = pytest.StashKey()
_by_file: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
_by_test: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
_spans: dict[str, list[object]] = {}
_began = time.monotonic()


def _cpu_s() -> float:
    me, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                   resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_start] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    if call.when == "teardown" and _start in item.stash:
        outcome.get_result().user_properties.append((KEY, _cpu_s() - item.stash[_start]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    cpu = sum(float(v) for k, v in report.user_properties if k == KEY)
    path = report.nodeid.split("::")[0]
    for entry in (_by_file[path], _by_test[report.nodeid]):
        entry[0] += cpu
        entry[1] += report.duration  # setup, call and teardown
    now = time.monotonic() - _began
    node = getattr(report, "node", None)  # xdist: the test process that ran it
    span = _spans.setdefault(path, [str(getattr(getattr(node, "gateway", None), "id", "main")),
                                    now - report.duration, now])
    span[2] = now


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _by_file or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    total = sum(cpu for cpu, _ in _by_file.values())
    wall = time.monotonic() - _began
    cores = os.cpu_count() or 1
    tr = terminalreporter
    tr.section(f"CPU by test file (top {TOP})")
    tr.write_line(f"{'CPU s':>8} {'wall s':>8}  file")
    for path, (cpu, spent) in sorted(_by_file.items(), key=lambda kv: -kv[1][0])[:TOP]:
        tr.write_line(f"{cpu:8.0f} {spent:8.0f}  {path}")
    tr.write_line(f"all {len(_by_file)} files: {total:.0f} CPU-s in {wall:.0f} s wall, "
                  f"{total / wall:.2f} of {cores} cores busy on average")
    out = os.environ.get("CPU_REPORT_JSON")
    if out:
        write_json_atomic(Path(out), {"tests": _by_test, "files": _by_file, "spans": _spans,
                                      "wall_s": wall,
                                      "cores": cores})
        tr.write_line(f"every test's and file's figures: {out}")
