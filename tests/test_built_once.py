"""tests/support/built_once.py: a shared fixture is built by the first process of the run that
asks, once, and a build that died half way is built again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.built_once import DONE, built_once

REPO = Path(__file__).resolve().parents[1]


def test_the_first_build_is_kept_and_one_that_failed_is_redone(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    calls: list[Path] = []

    def failing(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("killed half way")

    def build(out: Path) -> None:
        calls.append(out)
        (out / "model").write_text("trained")

    with pytest.raises(RuntimeError):
        built_once(tmp_path_factory, "t", failing)
    first = built_once(tmp_path_factory, "t", build)
    again = built_once(tmp_path_factory, "t", build)
    assert calls == [first] and again == first
    assert sorted(p.name for p in first.iterdir()) == [DONE, "model"]  # nothing half-built


_WORKER = """
import sys, time
from pathlib import Path
from tests.support.built_once import built_once

class Factory:  # what built_once reads of pytest's TempPathFactory
    def getbasetemp(self):
        return Path(sys.argv[1]) / sys.argv[2]

def build(out):
    with open(Path(sys.argv[1]) / "builds", "a") as f:
        f.write(sys.argv[2] + "\\n")
    time.sleep(0.5)  # long enough for the other worker to ask meanwhile
    (out / "model").write_text("trained")

print(built_once(Factory(), "shared", build))
"""


def test_two_workers_of_one_run_share_one_build(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path), w], cwd=REPO,
                                env={**env, "PYTEST_XDIST_WORKER": w}, text=True,
                                stdout=subprocess.PIPE) for w in ("gw0", "gw1")]
    outs = {w.communicate(timeout=60)[0].strip() for w in workers}
    assert all(w.returncode == 0 for w in workers)
    assert outs == {str(tmp_path / "once-shared")}
    assert len((tmp_path / "builds").read_text().split()) == 1
    assert (tmp_path / "once-shared" / "model").read_text() == "trained"
