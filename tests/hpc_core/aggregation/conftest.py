"""Aggregation tests: a real folder registry of numpy-made releases and device fine-tunes,
and ``hpc-train aggregate`` run in-process through its own argument parser."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from hpc_core.aggregation.command import register_cli
from tests.support.fleet_registry import FleetRegistry

# The worked example of the strategy tests: five updates of a 2x3 weight and a bias, the last
# an outlier. Deltas against a zero base (every value exact in float32).
HAND_DELTAS = [
    {"w": [[1, 2, 3], [4, 5, 6]], "b": [0, 10]},
    {"w": [[2, 2, 2], [2, 2, 2]], "b": [1, -10]},
    {"w": [[3, 0, 1], [0, 0, 0]], "b": [2, 0]},
    {"w": [[4, 4, 4], [4, 4, 4]], "b": [3, 1]},
    {"w": [[100, -100, 0], [0, 0, 50]], "b": [4, 2]},
]
HAND_EXPECTED = {
    "fedavg": {"w": [[22, -18.4, 2], [2, 2.2, 12.4]], "b": [2, 0.6]},
    "median": {"w": [[3, 2, 2], [2, 2, 4]], "b": [2, 1]},
    "trimmed-mean": {"w": [[3, 4 / 3, 2], [2, 2, 4]], "b": [2, 1]},  # trim 0.2: 1 per end
    "krum": {"w": [[4, 4, 4], [4, 4, 4]], "b": [3, 1]},  # f=1: update 3 (score 76 + 109)
}


def reference_krum_scores(updates: np.ndarray, f: int) -> list[float]:
    """Blanchard et al. 2017, straight from the definition, on whole (flattened) updates:
    each one's summed squared distance to its N - f - 2 nearest others."""
    n = len(updates)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((updates[i].astype(np.float64) - updates[j]) ** 2))
                   for j in range(n) if j != i)
        scores.append(sum(d[: n - f - 2]))
    return scores


def reference_krum(updates: np.ndarray, f: int) -> int:
    return int(np.argmin(reference_krum_scores(updates, f)))


def reference_multi_krum(updates: np.ndarray, f: int, keep: int,
                         samples: list[float]) -> np.ndarray:
    """Multi-Krum from the definition: the ``keep`` best Krum scores, averaged by samples."""
    scores = reference_krum_scores(updates, f)
    kept = sorted(range(len(updates)), key=lambda i: (scores[i], i))[:keep]
    w = np.array([samples[i] for i in kept]) / sum(samples[i] for i in kept)
    return w @ updates[kept].astype(np.float64)


def hand_deltas() -> list[dict[str, np.ndarray]]:
    return [{k: np.array(v, dtype=np.float32) for k, v in d.items()} for d in HAND_DELTAS]


@pytest.fixture
def fleet(tmp_path: Path) -> FleetRegistry:
    return FleetRegistry.create(tmp_path / "fleet")


@dataclass
class Result:
    code: int
    out: Path
    stdout: str
    stderr: str

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.out / "aggregate.json").read_text())

    @property
    def tensors(self) -> dict[str, np.ndarray]:
        return load_file(str(self.out / "model.safetensors"))

    def skipped(self) -> dict[str, str]:
        return {row["version"]: row["reason"] for row in self.report["skipped"]}


def run_cli(argv: list[str], out: Path) -> Result:
    parser = argparse.ArgumentParser(prog="hpc-train")
    register_cli(parser.add_subparsers(dest="command", required=True))
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            args = parser.parse_args(argv)
            code = args.func(args)
        except SystemExit as e:  # argparse's own refusals
            code = int(e.code or 0)
    return Result(code, out, stdout.getvalue(), stderr.getvalue())


@pytest.fixture
def aggregate(fleet: FleetRegistry, tmp_path: Path) -> Callable[..., Result]:
    """aggregate(*options, base="1"): run `hpc-train aggregate` on the fleet's registry."""
    runs = iter(range(1_000))

    def run(*options: str, base: str = "1", registry: str | None = None) -> Result:
        out = tmp_path / f"aggregate-{next(runs)}"
        argv = ["aggregate", "--registry", registry or str(fleet.root), "--model", fleet.name,
                "--base", base, "--trusted-keys", str(fleet.trusted), "--out", str(out),
                *options]
        return run_cli(argv, out)

    return run
