"""Streaming, measured: 20 updates of an 8 MiB float32 model aggregate in a fresh process
whose peak RSS grows by less than 3x the model (20 whole models would be 160 MiB), and that
process never imports torch."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.fleet_registry import FleetRegistry

N = 20
ROWS, COLS = 512, 1024  # 2 MiB per float32 tensor

CHILD = """
import json, sys
from pathlib import Path
import numpy as np  # what the run needs anyway, imported before the baseline
from hpc_core.aggregation.options import Options
from hpc_core.aggregation.round import run_round
def status(field):  # bytes; VmHWM: this process's peak RSS
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024
# Baseline: the RSS now (an import's passing peak must not hide what the run adds). Peak:
# VmHWM, not getrusage's ru_maxrss, which Linux carries over fork and exec from the parent
# (a pytest process that holds torch would read as this child's peak).
before = status("VmRSS")
report = run_round(Options(registry=sys.argv[1], model="digits", base="1",
                           strategy=sys.argv[2], trusted_keys=Path(sys.argv[3]),
                           out=Path(sys.argv[4])))
after = status("VmHWM")
print(json.dumps({"growth_bytes": after - before, "combined": len(report["combined"]),
                  "torch": "torch" in sys.modules}))
"""


@pytest.fixture(scope="module")
def big_fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[FleetRegistry, int]:
    fleet = FleetRegistry.create(tmp_path_factory.mktemp("memory") / "fleet",
                                 chunk_size=1 << 20, pack_below=64 << 10)
    rng = np.random.default_rng(0)
    base = {f"layer{i}.weight": rng.normal(size=(ROWS, COLS)).astype(np.float32)
            for i in range(4)}
    base["layer0.bias"] = np.zeros(COLS, np.float32)
    release = fleet.release("1", base)
    for i in range(N):
        # Every tensor changes (nothing can be skipped as unchanged).
        tensors = {k: v + np.float32(0.01 * (i + 1)) for k, v in base.items()}
        fleet.update(fleet.device(f"dev-{i}"), release, tensors)
    return fleet, sum(v.nbytes for v in base.values())


@pytest.mark.parametrize("strategy", ["fedavg", "median"])
def test_peak_memory_grows_by_less_than_three_models(
        strategy: str, big_fleet: tuple[FleetRegistry, int], tmp_path: Path, python: str,
        subprocess_env: dict[str, str]) -> None:
    fleet, model_bytes = big_fleet
    out = subprocess.run(
        [python, "-c", CHILD, str(fleet.root), strategy, str(fleet.trusted),
         str(tmp_path / "out")],
        env=subprocess_env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["combined"] == N
    assert not got["torch"]
    growth = got["growth_bytes"]
    assert growth < 3 * model_bytes, (
        f"{strategy}: peak RSS grew {growth / 2**20:.1f} MiB for a "
        f"{model_bytes / 2**20:.1f} MiB model x {N} updates")
