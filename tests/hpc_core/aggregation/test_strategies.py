"""The combining functions on whole arrays: a worked example, and scipy/numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from hpc_core.aggregation import strategies
from hpc_core.aggregation.deltas import squared_norm
from hpc_core.aggregation.strategies import (
    PairwiseDistances,
    combine_block,
    distances_to_mean,
    fedavg_weights,
    krum_kept,
    krum_scores,
    staleness_scale,
)
from tests.hpc_core.aggregation.conftest import (
    HAND_DELTAS,
    HAND_EXPECTED,
    reference_krum,
    reference_multi_krum,
)


def _flat(d: dict) -> np.ndarray:
    return np.concatenate([np.ravel(d["w"]), np.ravel(d["b"])]).astype(np.float32)


HAND = np.stack([_flat(d) for d in HAND_DELTAS])


@pytest.mark.parametrize("strategy", ["fedavg", "median", "trimmed-mean"])
def test_the_worked_example(strategy: str) -> None:
    weights = np.full(5, 0.2)
    got = combine_block(strategy, HAND, weights=weights, trim=0.2)  # type: ignore[arg-type]
    np.testing.assert_allclose(got, _flat(HAND_EXPECTED[strategy]), rtol=1e-6)


def test_krum_on_the_worked_example_picks_update_3() -> None:
    distances = PairwiseDistances(5)
    distances.add(HAND[:, :4])  # two blocks: the Gram matrix adds up
    distances.add(HAND[:, 4:])
    d2 = distances.squared()
    assert d2[2, 3] == 76 and d2[0, 3] == 109 and d2[1, 2] == 119
    scores = krum_scores(d2, f=1)
    chosen = int(krum_kept(scores, 1)[0])
    assert chosen == 3 and scores[3] == 76 + 109 and scores[2] == 76 + 119
    assert chosen == reference_krum(HAND, 1)


def test_multi_krum_on_the_worked_example_keeps_the_four_without_the_outlier() -> None:
    distances = PairwiseDistances(5)
    distances.add(HAND)
    d2 = distances.squared()
    scores = krum_scores(d2, f=1)
    # Scores with f = 1 (two nearest others each): update 3 76 + 109, update 2 76 + 119,
    # update 1 119 + 149, update 0 109 + 193; the outlier's nearest are ~2e4 away.
    assert scores.tolist()[:4] == [302, 268, 195, 185] and scores[4] > 40_000
    kept = krum_kept(scores, 4)
    assert kept.tolist() == [3, 2, 1, 0]
    w = np.full(4, 0.25)
    mean = w @ HAND[kept].astype(np.float64)
    np.testing.assert_allclose(mean, reference_multi_krum(HAND, 1, 4, [1.0] * 5))
    # Distances to the mean from the pairwise ones alone equal the direct ones.
    direct = np.linalg.norm(HAND.astype(np.float64) - mean, axis=1)
    np.testing.assert_allclose(distances_to_mean(d2, kept, w), direct, rtol=1e-9)


@pytest.mark.parametrize("n", [3, 7, 10])
def test_blockwise_equals_the_whole_array_references(n: int) -> None:
    rng = np.random.default_rng(n)
    updates = rng.normal(size=(n, 257)).astype(np.float32)
    blocks = [(0, 100), (100, 200), (200, 257)]

    def streamed(strategy: str, **kw: object) -> np.ndarray:
        return np.concatenate([combine_block(strategy, updates[:, a:b], **kw)  # type: ignore
                               for a, b in blocks])

    w = rng.uniform(1, 5, n)
    w /= w.sum()
    np.testing.assert_allclose(streamed("fedavg", weights=w, trim=0), w @ updates, rtol=1e-5,
                               atol=1e-6)
    for trim in (0.1, 0.2, 0.34):
        np.testing.assert_allclose(streamed("trimmed-mean", weights=w, trim=trim),
                                   stats.trim_mean(updates, trim, axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(streamed("median", weights=w, trim=0),
                               np.median(updates, axis=0), rtol=1e-6)
    distances = PairwiseDistances(n)
    for a, b in blocks:
        distances.add(updates[:, a:b])
    for f in range(0, (n - 3) // 2 + 1):
        d2 = distances.squared()
        assert krum_kept(krum_scores(d2, f), 1)[0] == reference_krum(updates, f)
        kept = krum_kept(krum_scores(d2, f), n - f)
        samples = rng.uniform(1, 100, n).tolist()
        kw = np.array([samples[i] for i in kept]) / sum(samples[i] for i in kept)
        mean = kw @ updates[kept].astype(np.float64)
        np.testing.assert_allclose(mean, reference_multi_krum(updates, f, n - f, samples),
                                   rtol=1e-9)
        np.testing.assert_allclose(distances_to_mean(d2, kept, kw),
                                   np.linalg.norm(updates - mean, axis=1), rtol=1e-5)


@pytest.mark.parametrize(("threads", "piece"), [(1, 4096), (2, 7), (3, 50), (4, 1)])
def test_order_statistics_spread_over_threads_equal_the_references(
        threads: int, piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pieces of columns sorted on several threads, uneven last pieces and threads with
    # nothing to do included, must give what the whole-array references give.
    monkeypatch.setattr(strategies, "WORKER_THREADS", threads)
    monkeypatch.setattr(strategies, "COLUMNS_PER_PIECE", piece)
    rng = np.random.default_rng(threads)
    for n in (8, 9):
        updates = rng.normal(size=(n, 301)).astype(np.float32)
        updates[n - 1, ::3] *= 1e6  # outliers that trimming and the median must drop
        # Either layout gives the same values and leaves the block as it was (the combining
        # pass measures each update's distance to the result after).
        for block in (updates.copy(), np.asfortranarray(updates)):
            np.testing.assert_allclose(
                combine_block("trimmed-mean", block, weights=np.empty(0), trim=0.25),
                stats.trim_mean(updates, 0.25, axis=0), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(
                combine_block("median", block, weights=np.empty(0), trim=0),
                np.median(updates.astype(np.float64), axis=0))
            np.testing.assert_array_equal(block, updates)


def test_weights_and_the_staleness_discount() -> None:
    w, by = fedavg_weights([10.0, 30.0])
    assert by == "samples" and np.allclose(w, [0.25, 0.75])
    w, by = fedavg_weights([10.0, None, 30.0])  # one update without a count: all alike
    assert by == "equal" and np.allclose(w, 1 / 3)
    assert staleness_scale(0) == 1.0
    assert staleness_scale(1) == pytest.approx(2 ** -0.5)
    assert staleness_scale(3) == pytest.approx(0.5)


def test_squared_norm_is_exact_enough_and_tells_huge_from_nan() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(300_000).astype(np.float32)
    ref = rng.standard_normal(300_000).astype(np.float32)
    exact = float(np.sum((values.astype(np.float64) - ref) ** 2))
    assert squared_norm(values - ref, values, ref) == pytest.approx(exact, rel=1e-5)
    # A finite update scaled past float32's square root (1e20: its square overflows float32)
    # is huge, not "NaN or infinity": float64 measures it, so it is clipped or reported.
    huge = np.full(4, 1e20, np.float32)
    zero = np.zeros(4, np.float32)
    with np.errstate(over="ignore"):  # as its callers run it
        assert squared_norm(huge - zero, huge, zero) == pytest.approx(4e40, rel=1e-6)
    nan = np.array([1.0, np.nan], np.float32)
    assert math.isnan(squared_norm(nan - zero[:2], nan, zero[:2]))
