"""Two poisoned updates of eight (scaled x50 and sign-flipped): the robust strategies stay
near the clean mean, the plain mean does not."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.hpc_core.aggregation.conftest import Result
from tests.support.fleet_registry import FleetRegistry


@pytest.fixture(params=[-50.0])
def poisoned(fleet: FleetRegistry, request: pytest.FixtureRequest) -> tuple[dict, np.ndarray]:
    """Six honest updates near one direction, two at ``request.param`` x that direction."""
    rng = np.random.default_rng(7)
    base = {"w": rng.normal(size=(64, 32)).astype(np.float32),
            "b": rng.normal(size=32).astype(np.float32)}
    release = fleet.release("1", base)
    truth = {k: rng.normal(size=v.shape).astype(np.float32) * 0.01 for k, v in base.items()}
    clean = [{k: t + rng.normal(size=t.shape).astype(np.float32) * 0.002
              for k, t in truth.items()} for _ in range(6)]
    bad = [{k: request.param * t for k, t in truth.items()} for _ in range(2)]
    fleet.fine_tunes(release, base, clean + bad)
    clean_mean = np.concatenate([np.mean([c[k] for c in clean], axis=0).ravel()
                                 for k in ("w", "b")])
    return base, clean_mean


def _delta(result: Result, base: dict) -> np.ndarray:
    assert result.code == 0, result.stderr
    return np.concatenate([(result.tensors[k] - base[k]).ravel() for k in ("w", "b")])


def test_trimmed_mean_and_median_resist_what_moves_fedavg_far(
        poisoned: tuple[dict, np.ndarray], aggregate: Callable[..., Result]) -> None:
    base, clean_mean = poisoned
    scale = np.linalg.norm(clean_mean)
    errors = {
        name: np.linalg.norm(_delta(aggregate("--strategy", strategy, *extra), base)
                             - clean_mean) / scale
        for name, strategy, extra in (
            ("fedavg", "fedavg", []), ("median", "median", []),
            ("trimmed-mean", "trimmed-mean", ["--trim", "0.25"]),
            ("krum", "krum", ["--krum-f", "2"]),
            ("multi-krum", "krum", ["--krum-f", "2", "--krum-keep", "6"]))
    }
    assert errors["fedavg"] > 10  # (6 - 100) / 8: the mean is dragged 12x the signal away
    assert errors["median"] < 0.25
    assert errors["trimmed-mean"] < 0.25
    assert errors["krum"] < 0.5  # one clean update: its own noise, no poison
    assert errors["multi-krum"] < 1e-5  # the six honest ones kept: the clean mean itself


def test_clipping_bounds_what_a_poisoned_update_can_do_to_fedavg(
        poisoned: tuple[dict, np.ndarray], aggregate: Callable[..., Result]) -> None:
    base, clean_mean = poisoned
    scale = np.linalg.norm(clean_mean)
    result = aggregate("--clip-norm", f"{scale * 1.05:.6f}")
    error = np.linalg.norm(_delta(result, base) - clean_mean) / scale
    assert 0.3 < error < 1.0  # two bounded pulls against six: moved, not overturned
    rows = result.report["updates"]
    assert max(r["clipped_norm"] for r in rows) == pytest.approx(scale * 1.05, rel=1e-5)
    assert sorted(r["norm"] > 40 * scale for r in rows) == [False] * 6 + [True] * 2


@pytest.mark.parametrize(("poisoned", "honest_only"), [(50.0, False), (-50.0, True)],
                         indirect=["poisoned"], ids=["scaled", "flipped"])
def test_multi_krum_behind_a_median_clip_lands_on_the_clean_mean(
        poisoned: tuple[dict, np.ndarray], honest_only: bool,
        aggregate: Callable[..., Result]) -> None:
    # Clipped to an honest norm a scaled update lies on the honest direction and may be kept
    # (it is then one honest update's worth); a flipped one lies opposite every honest update,
    # scores worst and is never kept. Either way: the clean mean, not (6 - 2) / 8 of it as a
    # median-clipped fedavg gives against the flip.
    base, clean_mean = poisoned
    scale = np.linalg.norm(clean_mean)
    result = aggregate("--strategy", "krum", "--krum-f", "2", "--krum-keep", "6",
                       "--clip-norm", "median")
    assert result.report["params"]["krum_keep"] == 6
    rows = result.report["updates"]
    assert sum(r["chosen"] for r in rows) == 6
    assert np.linalg.norm(_delta(result, base) - clean_mean) / scale < 0.05
    bad = [r["norm"] > 40 * scale for r in rows]
    assert sum(bad) == 2
    if honest_only:
        assert [r["chosen"] for r in rows] == [not b for b in bad]


@pytest.mark.parametrize(("poisoned", "low", "high"), [(50.0, 0.0, 0.05), (-50.0, 0.4, 0.6)],
                         indirect=["poisoned"], ids=["scaled", "flipped"])
def test_a_median_clip_bounds_each_update_by_an_honest_norm(
        poisoned: tuple[dict, np.ndarray], low: float, high: float,
        aggregate: Callable[..., Result]) -> None:
    # No number to guess: the bound is the median of the round's norms, with two bad updates
    # of eight an honest update's norm. A scaled-up update then counts as an honest one
    # (error ~0); a flipped one takes back one honest update's worth: (6 - 2) / 8 of the
    # clean mean's length, so the error is ~0.5, the direction kept.
    base, clean_mean = poisoned
    scale = np.linalg.norm(clean_mean)
    result = aggregate("--clip-norm", "median")
    rows = result.report["updates"]
    bound = float(np.median([r["norm"] for r in rows]))
    assert result.report["params"]["clip_norm"] == "median"
    assert result.report["clip_bound"] == pytest.approx(bound, rel=1e-6)
    assert bound < 1.2 * scale  # an honest norm, not the attackers' 50x
    assert max(r["clipped_norm"] for r in rows) == pytest.approx(bound, rel=1e-5)
    delta = _delta(result, base)
    assert low <= np.linalg.norm(delta - clean_mean) / scale < high
    assert np.dot(delta, clean_mean) > 0
