"""One round's combination of updates held in memory (an N x D array of deltas), by the rules
``hpc-train aggregate`` applies to the uploads it streams from a registry.

For simulations that would otherwise publish N checkpoints a round (the fleet-learning
protocol benchmark runs thousands of rounds): the same clip bound (``clip_norm``, a number or
the round's median norm, :func:`privacy.clip_scale`), the same weights
(:func:`strategies.fedavg_weights`; under DP :func:`privacy.dp_weights`), Krum's and
Multi-Krum's choice (:class:`strategies.PairwiseDistances`, :func:`strategies.krum_scores`,
:func:`strategies.krum_kept`), the same combination (:func:`strategies.combine_block`), DP's
Gaussian noise (:class:`privacy.GaussianNoise`) and the server step. ``round.run_round``
applies each block by block; every one is coordinate-wise or made from whole-update norms and
distances, so the whole array as one block is the same computation
(``tests/hpc_core/aggregation/test_in_memory.py`` checks it against ``run_round`` on a
registry).

A late update (trained from a release ``staleness`` rounds behind the base, its delta taken
against that release as ``run_round`` takes it) is scaled by FedBuff's discount,
:func:`strategies.staleness_scale`, times its clip scale, as ``run_round``'s ``Scales.total``.

Not here, because a simulation has nothing for them to act on: selection (which late updates
``--max-staleness`` admits is the caller's), signatures, chunk hashes, near-duplicate flags and
the report. Nor running statistics: the deltas are of trained weights only (BatchNorm's
running mean and variance would take the combined value without the server step, and keep
the base's under DP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hpc_core.aggregation.options import DEFAULT_KRUM_F, DEFAULT_TRIM, MEDIAN_CLIP
from hpc_core.aggregation.privacy import DpSettings, GaussianNoise, clip_scale, dp_weights
from hpc_core.aggregation.strategies import (
    STRATEGIES,
    PairwiseDistances,
    Strategy,
    combine_block,
    fedavg_weights,
    krum_kept,
    krum_scores,
    min_updates,
    staleness_scale,
)


@dataclass(frozen=True)
class Rule:
    """How a round combines its updates: ``hpc-train aggregate``'s options of the same names
    (see ``options.Options``)."""

    strategy: Strategy = "fedavg"
    trim: float = DEFAULT_TRIM
    """trimmed-mean: fraction of values dropped at each end of each coordinate."""
    krum_f: int = DEFAULT_KRUM_F
    """krum: Byzantine updates tolerated."""
    krum_keep: int = 1
    """krum: the best-scored updates averaged (1: Krum; more: Multi-Krum)."""
    clip_norm: float | Literal["median"] | None = None
    """Clip each update to this L2 norm; "median": to the round's median update norm."""
    server_lr: float = 1.0
    """The step is server_lr x the combined delta."""
    dp: DpSettings | None = None
    """Central DP (fedavg with a fixed ``clip_norm`` only, as ``Options.check`` demands)."""

    def check(self) -> None:
        """ValueError naming the field and the fix."""
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: one of {', '.join(STRATEGIES)}")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trim {self.trim}: a fraction in [0, 0.5) dropped at each end")
        if self.krum_f < 0 or self.krum_keep < 1:
            raise ValueError(f"krum_f {self.krum_f} >= 0 and krum_keep {self.krum_keep} >= 1")
        if self.dp is not None and (self.strategy != "fedavg"
                                    or not isinstance(self.clip_norm, (int, float))):
            raise ValueError("dp: fedavg with a fixed clip_norm only (the noise is calibrated "
                             "to the clipped updates' sensitivity)")


def combine_updates(deltas: np.ndarray, samples: Sequence[float | None], rule: Rule,
                    rng: np.random.Generator | None = None,
                    staleness: Sequence[int] | None = None) -> np.ndarray:
    """The server's step (float64, length D) from the N x D ``deltas`` (update - the model
    they were trained from), each device's training sample count in ``samples`` (None: not
    given) and, in ``staleness``, how many releases behind the base each update's own
    release is (None: every update fresh). An update holding NaN or infinity is left out, as
    ``run_round`` skips it; too few left for the strategy is a ValueError. ``rng`` draws the
    DP noise (None: seeded from the OS)."""
    rule.check()
    block = np.asarray(deltas, dtype=np.float32)
    stale = [0] * len(samples) if staleness is None else list(staleness)
    if block.ndim != 2 or len(samples) != block.shape[0] or len(stale) != block.shape[0]:
        raise ValueError(f"deltas {block.shape}, {len(samples)} sample counts and "
                         f"{len(stale)} staleness values: one row, count and staleness per "
                         "update")
    if any(s < 0 for s in stale):
        raise ValueError(f"staleness {stale}: releases behind the base, 0 or more")
    norms = np.sqrt(np.einsum("ij,ij->i", block, block, dtype=np.float64))
    finite = np.isfinite(norms)
    block, norms = block[finite], norms[finite]
    counts = [s for s, ok in zip(samples, finite, strict=True) if ok]
    stale = [s for s, ok in zip(stale, finite, strict=True) if ok]
    need = min_updates(rule.strategy, rule.trim, rule.krum_f, rule.krum_keep)
    if len(block) < need:
        raise ValueError(f"{len(block)} finite updates; {rule.strategy} needs {need}")
    bound = rule.clip_norm
    if bound == MEDIAN_CLIP:
        bound = float(np.median(norms))
    assert not isinstance(bound, str)
    # run_round's Scales.total: the clip bound is taken on the raw norms, then the discount
    scales = np.array([clip_scale(float(n), bound) * staleness_scale(s)
                       for n, s in zip(norms, stale, strict=True)], dtype=np.float32)
    if (scales != 1.0).any():
        block = block * scales[:, None]
    noise = None
    if rule.dp is not None:
        weights, _ = dp_weights(counts, rule.dp)
        noise = GaussianNoise(rule.dp.noise_std, rng)
    elif rule.strategy == "fedavg":
        weights, _ = fedavg_weights(counts)
    else:
        weights = np.empty(0)
    if rule.strategy == "krum":
        distances = PairwiseDistances(len(block))
        distances.add(block)
        kept = krum_kept(krum_scores(distances.squared(), rule.krum_f), rule.krum_keep)
        # Multi-Krum averages what it keeps as fedavg would, as run_round does.
        kept_w, _ = fedavg_weights([counts[int(i)] for i in kept])
        combined = combine_block("fedavg", block[kept], weights=kept_w, trim=0.0)
    else:
        combined = combine_block(rule.strategy, block, weights=weights, trim=rule.trim)
    if noise is not None:
        noise.add(combined)
    if rule.server_lr != 1.0:
        combined *= rule.server_lr
    return combined
