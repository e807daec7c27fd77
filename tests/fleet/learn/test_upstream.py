"""How ``fleetctl learn`` starts the upstream tools (``fleet.learn.upstream.ToolRun``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleet.learn.upstream import HPC_TRAIN_ENV, ToolRun, hpc_train_command


def _wait(run: ToolRun, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while (code := run.poll()) is None:
        assert time.monotonic() < deadline, run.tail()
        time.sleep(0.05)
    return code


def test_the_default_tool_runs_from_a_folder_holding_folders_named_like_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An operator's working folder with a folder registry in it (``registry/chunks/``) must
    not stand in for the ``registry`` package (``python -m`` would import it: the working
    folder comes first on its module path)."""
    monkeypatch.delenv(HPC_TRAIN_ENV, raising=False)
    for d in ("registry/chunks", "fleet", "hpc_core"):
        (tmp_path / d).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    run = ToolRun(hpc_train_command(), ["publish", "--help"], tmp_path / "logs" / "publish.log")
    assert _wait(run) == 0, run.log.read_text()
    assert "--sign-key" in run.log.read_text()


def test_a_tool_that_crashes_is_told_from_one_that_found_too_few_updates(
    tmp_path: Path,
) -> None:
    """Both exit 1; the crash is reported as EXIT_CRASHED (the learn stops, no round skipped)."""
    script = "import sys; sys.argv[1] == 'crash' and 1 / 0; sys.exit(1)"
    crash = ToolRun(["python3", "-c", script], ["crash"], tmp_path / "crash.log")
    too_few = ToolRun(["python3", "-c", script], ["few"], tmp_path / "few.log")
    assert _wait(crash) == 70 and "ZeroDivisionError" in crash.tail()
    assert _wait(too_few) == 1
    # The log is appended to across controller restarts: an earlier run's traceback does not
    # make a later "too few" a crash.
    again = ToolRun(["python3", "-c", script], ["few"], tmp_path / "crash.log")
    assert _wait(again) == 1
