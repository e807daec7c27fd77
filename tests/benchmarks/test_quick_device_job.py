"""``--quick`` runs of the whole-device-job benchmarks (worker, memory probes, fine-tune,
INT8 export, health), the heaviest quick runs: a file of their own, for a worker of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick import DEVICE_JOB, run_quick

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", DEVICE_JOB)
def test_quick(script: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    run_quick(script, tmp_path, subprocess_env)
