"""``--quick`` runs of the light benchmarks (fleet, broker, registry, aggregation, spool,
governor, federated learning) and of any new script: every ``benchmarks/*.py`` is in exactly
one of the three test_quick files, or a listed helper. See tests/benchmarks/quick.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick import (
    BENCHMARKS,
    DEVICE_JOB,
    NOT_BENCHMARKS,
    TRAINING,
    has_main,
    light,
    run_quick,
    scripts,
)


def test_every_script_is_run_once_or_listed_as_a_helper() -> None:
    found = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert sorted([*light(), *DEVICE_JOB, *TRAINING, *NOT_BENCHMARKS]) == found
    assert set(DEVICE_JOB + TRAINING) <= set(scripts()), "a group names a missing script"
    for name in scripts():
        assert has_main(BENCHMARKS / name), f"{name}: no main; list it in NOT_BENCHMARKS"
    for name, why in NOT_BENCHMARKS.items():
        assert not has_main(BENCHMARKS / name), f"{name} has a main now; it was: {why}"


@pytest.mark.parametrize("script", light())
def test_quick(script: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    run_quick(script, tmp_path, subprocess_env)


def test_make_bench_runs_the_same_scripts() -> None:
    """``make bench`` and ``make bench-quick`` take every benchmarks/*.py but these helpers."""
    makefile = (BENCHMARKS.parent / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if ln.startswith("BENCH_HELPERS :="))
    helpers = {Path(p).name for p in line.split(":=", 1)[1].split()}
    assert helpers == set(NOT_BENCHMARKS)
