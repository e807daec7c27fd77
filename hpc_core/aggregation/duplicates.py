"""Near-identical updates in one round: a Sybil signal.

One device's update replayed under several keys counts as several devices: its weight is
multiplied, a robust rule's count of bad updates is off, and under DP the per-device
sensitivity the noise was calibrated to no longer bounds that device (k copies move the
aggregate by k x S). Two updates are near-identical when their deltas' L2 norms agree within
``NORM_RTOL`` (relative) and their cosine is at least ``MIN_COSINE``; the report lists each
connected group of them (``duplicates``) and marks their rows.

What the round does with them: it keeps and flags them. Counting a group once would be sound
for exact copies (equality is transitive: adding or removing one device changes one group's
weight, within S), but near-identity is not transitive: one device near two groups would join
them and take one group out of the aggregate, a move larger than the S it is meant to
protect. Refusing the round would hand anyone with a second trusted key a veto over every
round. So every key keeps its one update's weight (the guarantee per key holds as stated), and
the report says what a device behind k keys gets: the guarantee of noise multiplier z / k.

Cost: norms come from the measuring pass; only updates whose norm matches another's within
``NORM_RTOL`` (none, in an honest round) are read again, for their Gram matrix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from hpc_core.aggregation.combine import Blobs, combined_tensors, numel, per_row, stacked
from hpc_core.aggregation.deltas import Deltas, element_blocks
from hpc_core.aggregation.strategies import PairwiseDistances

MIN_COSINE = 0.9999
NORM_RTOL = 1e-6


@dataclass(frozen=True)
class DuplicateGroup:
    members: list[int]
    """Indices into the round's measured updates, ascending."""
    keys: int
    """Distinct signing keys among them."""
    min_cosine: float
    """The smallest cosine between two members found near-identical."""
    norm_spread: float
    """(largest - smallest norm) / largest, over the members."""


def norm_candidates(norms: list[float], rtol: float = NORM_RTOL) -> list[int]:
    """Indices whose norm lies within ``rtol`` (relative) of another's; zero norms are left
    out (an update that changes nothing carries nothing to replay)."""
    order = sorted((n, i) for i, n in enumerate(norms) if n > 0 and np.isfinite(n))
    out: set[int] = set()
    for (a, i), (b, j) in itertools.pairwise(order):
        if b - a <= rtol * b:
            out.update((i, j))
    return sorted(out)


def near_identical(norms: list[float], gram: np.ndarray, members: list[int],
                   keys: list[str]) -> list[DuplicateGroup]:
    """Groups (connected components) of ``members`` whose pairs pass both tests; ``gram`` is
    the members' Gram matrix, in ``members`` order; ``keys`` every update's key id."""
    n = len(members)
    parent = list(range(n))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    cos_min: dict[int, float] = {}
    pairs = []
    diag = np.sqrt(np.maximum(np.diag(gram), 0.0))
    for a in range(n):
        for b in range(a + 1, n):
            na, nb = norms[members[a]], norms[members[b]]
            if abs(na - nb) > NORM_RTOL * max(na, nb) or diag[a] == 0 or diag[b] == 0:
                continue
            cos = float(gram[a, b] / (diag[a] * diag[b]))
            if cos >= MIN_COSINE:
                pairs.append((a, b, cos))
                parent[root(a)] = root(b)
    for a, _, cos in pairs:
        r = root(a)
        cos_min[r] = min(cos_min.get(r, 1.0), cos)
    groups: dict[int, list[int]] = {}
    for a in range(n):
        groups.setdefault(root(a), []).append(members[a])
    out = []
    for r, idx in groups.items():
        if len(idx) < 2:
            continue
        g_norms = [norms[i] for i in idx]
        out.append(DuplicateGroup(sorted(idx), len({keys[i] for i in idx}),
                                  min(cos_min[r], 1.0),
                                  (max(g_norms) - min(g_norms)) / max(g_norms)))
    return sorted(out, key=lambda g: g.members)


def find_duplicates(blobs: Blobs, block_bytes: int) -> list[DuplicateGroup]:
    """The round's groups of near-identical updates (their deltas as measured: before
    clipping and the staleness discount, neither of which changes a cosine)."""
    norms = [m.norm for m in blobs.measured]
    members = norm_candidates(norms)
    if not members:
        return []
    # Unscaled copies: the round sets each update's clip and staleness scale on its own.
    deltas = Deltas([replace(blobs.measured[i].data, scale=1.0) for i in members])
    return near_identical(norms, gram(deltas, blobs, block_bytes), members,
                          [m.update.key.key_id for m in blobs.measured])


def gram(deltas: Deltas, blobs: Blobs, block_bytes: int) -> np.ndarray:
    """The Gram matrix of ``deltas`` (as scaled), block by block (float64 sums)."""
    acc = PairwiseDistances(len(deltas.updates))
    step = per_row(block_bytes, len(deltas.updates))
    ranges = [(e.name, start, stop) for e in combined_tensors(blobs.base)
              for start, stop in element_blocks(numel(e), step)]
    for block in stacked(deltas, ranges):
        acc.add(block)
    return acc.gram
