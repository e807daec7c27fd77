"""How N update deltas become one, on an N x block array of one tensor's element range.

* ``fedavg`` (McMahan et al. 2017): the weighted mean, weights summing to 1 (under DP the
  fixed-denominator weights of ``privacy.dp_weights``).
* ``trimmed-mean`` (Yin et al. 2018): per coordinate, drop the ``int(trim * N)`` smallest and
  as many largest values and average the rest (what ``scipy.stats.trim_mean`` computes).
* ``median``: the coordinate-wise median (``np.median``; the mean of the two middle values
  for an even N).
* ``krum`` (Blanchard et al. 2017): the one update whose summed squared distance to its
  N - f - 2 nearest others is smallest. It needs every pairwise distance first, accumulated
  block by block as a Gram matrix (:class:`PairwiseDistances`); the chosen update's delta is
  then the aggregate. Multi-Krum (``keep`` M > 1, Blanchard et al. 2017 section 5, Flower's
  ``to_keep``) averages the M best-scored updates, weighted like fedavg: while the honest
  updates point more alike than apart, one pointing away from them - sign-flipped, say -
  scores worse than any honest one, and the mean of the rest is a mean of many honest
  updates, not one update's noise.

Every function here is coordinate-wise over a block, so the streaming combination over row
blocks equals the same function on the whole stacked models.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np

Strategy = Literal["fedavg", "trimmed-mean", "median", "krum"]
STRATEGIES: tuple[Strategy, ...] = ("fedavg", "trimmed-mean", "median", "krum")


def min_updates(strategy: Strategy, trim: float, krum_f: int, krum_keep: int) -> int:
    """The fewest updates the strategy is defined for."""
    if strategy == "krum":
        # Krum's guarantee needs N > 2f + 2; Multi-Krum keeps at most N - f.
        return max(2 * krum_f + 3, krum_keep + krum_f)
    return 1  # trim < 0.5 always leaves a value per coordinate


def trimmed_count(n: int, trim: float) -> int:
    """Values dropped at each end of each coordinate (scipy.stats.trim_mean's rule)."""
    return int(trim * n)


def fedavg(block: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sum_i weights[i] * block[i] as float64: one float32 matrix-vector product (BLAS, ~0.2 ns
    an element against ~1.5 for a float64 loop over the rows). Its float32 sums of N terms carry
    a relative error of ~1e-7, as Flower's float32 aggregate does; with weights that sum to 1 no
    partial sum can exceed the largest value, so float32 cannot overflow where float64 would
    not. (DP's fixed-denominator weights sum to turnout / expected weight, not 1; their deltas
    are clipped, so the sums stay far from float32's range.)"""
    return np.dot(weights.astype(np.float32), block).astype(np.float64)


# Order statistics: each coordinate's N values are a column of the N x block array. Sorting
# along axis 0 walks them strided (~15 ns an element for N = 100 on an AVX2 EPYC); a slice of
# columns copied to contiguous rows (its transpose, a cache-sized piece at a time) and sorted
# along the rows costs ~7 ns, and numpy releases the GIL in both, so the pieces are spread
# over a few threads. Each thread reduces its own rows straight into the output: no whole
# sorted copy of the block is ever held. (Copying the piece one row at a time into the
# columns of a reused buffer runs at ~1.1 ns an element against ~4.9 for this copy alone,
# but its 100 small copies a piece contend for the GIL with the thread stacking the next
# block: the pass measured ~1 s slower at 100 x 25 M.)
COLUMNS_PER_PIECE = 4096
"""Columns transposed and sorted at a time: N x 4096 float32 is 1.6 MB for N = 100."""
WORKER_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                            else (os.cpu_count() or 1)))
"""Threads the aggregation's compute may use: this process's cores, at most 4."""


def _order_statistic(block: np.ndarray, reduce: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``reduce`` (rows of sorted values -> one float64 per row) of every column of ``block``."""
    cols = block.shape[1]
    out = np.empty(cols, dtype=np.float64)

    def part(lo: int, hi: int) -> None:
        for c in range(lo, hi, COLUMNS_PER_PIECE):
            # Always a copy, whatever the block's layout: the caller still needs the block.
            rows = np.array(block[:, c:min(c + COLUMNS_PER_PIECE, hi)].T, order="C")
            rows.sort(axis=1)
            out[c:c + rows.shape[0]] = reduce(rows)

    pieces = -(-cols // COLUMNS_PER_PIECE)
    threads = min(WORKER_THREADS, pieces)
    if threads <= 1:
        part(0, cols)
        return out
    per = -(-pieces // threads) * COLUMNS_PER_PIECE
    # A pool per block: a block is milliseconds of work, a thread's start microseconds.
    with ThreadPoolExecutor(threads, thread_name_prefix="aggregate-sort") as pool:
        for f in [pool.submit(part, lo, min(lo + per, cols)) for lo in range(0, cols, per)]:
            f.result()
    return out


def trimmed_mean(block: np.ndarray, trim: float) -> np.ndarray:
    n = block.shape[0]
    k = trimmed_count(n, trim)
    if k == 0:
        return block.mean(axis=0, dtype=np.float64)
    return _order_statistic(block, lambda rows: rows[:, k : n - k].mean(axis=1, dtype=np.float64))


def median(block: np.ndarray) -> np.ndarray:
    n = block.shape[0]
    if n % 2:
        return _order_statistic(block, lambda rows: rows[:, n // 2].astype(np.float64))
    return _order_statistic(
        block, lambda rows: (rows[:, n // 2 - 1].astype(np.float64) + rows[:, n // 2]) / 2)


def combine_block(strategy: Strategy, block: np.ndarray, *, weights: np.ndarray,
                  trim: float) -> np.ndarray:
    """The combined delta of one block (krum is combined as fedavg with a one-hot weight)."""
    if strategy in ("fedavg", "krum"):
        return fedavg(block, weights)
    if strategy == "trimmed-mean":
        return trimmed_mean(block, trim)
    return median(block)


class PairwiseDistances:
    """Squared L2 distances between N updates, accumulated block by block (float64 Gram)."""

    def __init__(self, n: int) -> None:
        self.gram = np.zeros((n, n), dtype=np.float64)

    def add(self, block: np.ndarray) -> None:
        b = block.astype(np.float64)
        self.gram += b @ b.T

    def squared(self) -> np.ndarray:
        diag = np.diag(self.gram)
        d2 = diag[:, None] + diag[None, :] - 2.0 * self.gram
        np.fill_diagonal(d2, 0.0)
        return np.maximum(d2, 0.0)  # rounding may leave -1e-17 for identical updates


def krum_scores(d2: np.ndarray, f: int) -> np.ndarray:
    """Each update's sum of squared distances to its N - f - 2 nearest other updates."""
    n = d2.shape[0]
    m = n - f - 2
    if m < 1:
        raise ValueError(f"krum needs N - f - 2 >= 1 (N={n}, f={f})")
    scores = np.empty(n, dtype=np.float64)
    for i in range(n):
        others = np.delete(d2[i], i)
        scores[i] = np.sort(others)[:m].sum()
    return scores


def krum_kept(scores: np.ndarray, keep: int) -> np.ndarray:
    """The ``keep`` best-scored indices, best first (the lower index on a tie): Krum's pick
    alone for ``keep`` 1, Multi-Krum's set otherwise."""
    return np.argsort(scores, kind="stable")[:keep]


def distances_to_mean(d2: np.ndarray, members: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each update's L2 distance to sum_j weights[j] x update[members[j]] (weights summing to
    1), from the squared pairwise distances alone: |x_i - m|^2 = sum_j w_j |x_i - x_j|^2
    - 1/2 sum_jk w_j w_k |x_j - x_k|^2."""
    within = d2[np.ix_(members, members)]
    spread = 0.5 * float(weights @ within @ weights)
    return np.sqrt(np.maximum(d2[:, members] @ weights - spread, 0.0))


STALENESS_EXPONENT = 0.5


def staleness_scale(staleness: int) -> float:
    """FedBuff's discount (Nguyen et al. 2022): an update trained from a release ``staleness``
    releases behind the base has its delta multiplied by ``1 / (1 + staleness) ** 0.5``."""
    return float((1 + staleness) ** -STALENESS_EXPONENT)


def fedavg_weights(samples: list[float | None]) -> tuple[np.ndarray, str]:
    """Weights summing to 1: by training sample count when every update carries one, else
    equal (a mix of counted and uncounted updates has no fair common scale)."""
    if samples and all(s is not None for s in samples):
        w = np.array(samples, dtype=np.float64)
        return w / w.sum(), "samples"
    return np.full(len(samples), 1.0 / max(len(samples), 1)), "equal"
