"""``--quick`` runs of the benchmarks that train, probe and export in fresh torch processes
(the serving runtime, upstream tools, fine-tune memory, export, trainer overhead)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick import TRAINING, run_quick

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", TRAINING)
def test_quick(script: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    run_quick(script, tmp_path, subprocess_env)
