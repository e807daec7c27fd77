"""Central differential privacy for fedavg: DP-FedAvg's fixed-denominator estimator, Gaussian
noise calibrated to its sensitivity, and the (epsilon, delta) that buys.

The estimator (McMahan et al. 2018, "Learning differentially private recurrent language
models", the f_f estimator of DP-FedAvg)::

    aggregate = sum_k w_k * Delta_k / W

* every update's delta ``Delta_k`` is clipped to L2 norm ``C`` (a stale update's FedBuff
  discount, < 1, only shrinks it);
* a device's weight ``w_k = min(samples_k / cap, 1)`` with ``cap = --dp-weight-cap``; without
  a cap, or without a sample count, ``w_k = 1``. The sample count is the device's own claim
  and unbounded, so under DP it never weighs more than the cap allows;
* ``W = --dp-expected-weight``: the total weight a round is EXPECTED to bring (``q * sum_k
  w_k`` over the devices in reach, sampling rate ``q = 1`` here), fixed before the round and
  never taken from the updates that arrived.

Adding or removing one device's update changes the sum by ``w_k * Delta_k`` and nothing else,
so the aggregate moves by at most ``S = C * 1 / W`` (``C * w_max / W`` with ``w_max = 1``)
in L2, for every pair of neighbouring rounds: the bound depends on no data. The noise is
``N(0, (z * S)^2)`` on every coordinate, and the accountant is given that same ``z``.

Why not the renormalized mean ``sum_k w_k Delta_k / sum_k w_k`` fedavg uses without DP: its
denominator moves with the device added or removed, so that device also rescales everyone
else's contribution. With ``M'`` the mean without device k, the mean moves by ``w_k / sum w *
|Delta_k - M'|``, up to ``2 C w_k / sum w``: twice ``C * max(w)``, and up to ``2 C`` when one
device claims a huge sample count. Calibrating to that bound needs a floor under the
denominator (``max(W_min, sum w)``, sensitivity ``2 C / W_min``): twice the noise of the fixed
denominator for the same guarantee. The price of the fixed denominator is a step scaled by
``sum w / W`` when the turnout differs from the expectation (the report gives both): a
step-length error, not a direction one.

Adjacency: add or remove one device's update. One device is one signing key, so under DP the
round takes one update per key (:func:`one_per_key`). The published manifest names the
device versions combined, so whether a device took part is not hidden; what its data did is,
against the replacement of its update by any other in the clip ball: sensitivity ``2 S``, the
guarantee of noise multiplier ``z / 2`` (``epsilon_replace_one`` in the report).

(epsilon, delta) comes from Google's ``dp-accounting`` package (the accountant TensorFlow
Privacy and the DP libraries build on; kept up, numpy/scipy only, no ML framework): its Rényi
DP accountant composed over ``rounds`` releases of the same mechanism, without any
amplification by sampling (every selected device takes part in a round: ``q = 1``). It is
imported only when DP is asked for; it ships in the ``learn`` extra (``pip install -e
.[learn]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hpc_core.aggregation.select import Update
from registry.errors import UsageError

STATISTICS = ("running_mean", "running_var")
"""Tensor names' last parts for normalisation layers' running statistics (PyTorch BatchNorm)."""


def is_statistic(name: str) -> bool:
    """A BatchNorm running statistic. Under DP these keep the base's values: they are not
    trained but averaged from the device's own samples (a release of its data the clipped
    noise does not cover), and Gaussian noise on a running variance can make it negative,
    which puts NaN into every forward pass after it."""
    return name.rsplit(".", 1)[-1] in STATISTICS


ACCOUNTANT = "dp_accounting.rdp.RdpAccountant (Gaussian mechanism, add-or-remove-one adjacency)"
ESTIMATOR = ("DP-FedAvg fixed denominator (McMahan et al. 2018): sum_k min(samples_k / cap, 1) "
             "x clipped delta_k / expected_weight")
ADJACENCY = "add or remove one device's update (one update per signing key a round)"
MAX_WEIGHT = 1.0
"""The largest weight one device's update can carry (``w_k <= 1``)."""
SAMPLING_RATE = 1.0
"""q: every device in reach takes part; no amplification by sampling is claimed."""


@dataclass(frozen=True)
class DpSettings:
    noise_multiplier: float
    """z: noise std over the sensitivity S."""
    delta: float
    """delta of the (epsilon, delta) guarantee; keep it below 1 / (number of devices)."""
    rounds: int
    """Rounds of aggregation the accountant composes (each with this z)."""
    clip_norm: float
    """C: every update's delta is clipped to this L2 norm first."""
    expected_weight: float
    """W: the total device weight a round is expected to bring, fixed before the round (with
    equal weights: the number of updates expected)."""
    weight_cap: float | None = None
    """Samples at which a device's weight reaches 1 (``w = min(samples / cap, 1)``); None:
    every update weighs 1, whatever sample count it claims."""

    @property
    def sensitivity(self) -> float:
        """S = C * w_max / W: the most one device's update moves the aggregate (L2)."""
        return self.clip_norm * MAX_WEIGHT / self.expected_weight

    @property
    def noise_std(self) -> float:
        """sigma = z * S, per coordinate."""
        return self.noise_multiplier * self.sensitivity


def device_weights(samples: Sequence[float | None], cap: float | None) -> np.ndarray:
    """Each update's weight ``w_k`` in (0, 1]: ``min(samples_k / cap, 1)``; 1 without a cap
    or without a sample count (the most it may weigh, so the bound holds either way)."""
    return np.array([MAX_WEIGHT if cap is None or s is None else min(s / cap, MAX_WEIGHT)
                     for s in samples], dtype=np.float64)


def dp_weights(samples: Sequence[float | None], settings: DpSettings) -> tuple[np.ndarray, str]:
    """The fixed-denominator fedavg coefficients ``w_k / W`` (they sum to ``sum w / W``, not
    to 1) and how they were made, for the report."""
    w = device_weights(samples, settings.weight_cap)
    how = ("min(samples / cap, 1)" if settings.weight_cap is not None else "1 each")
    return w / settings.expected_weight, (
        f"dp fixed denominator: {how} / expected weight {settings.expected_weight:g}")


def clip_scale(norm: float, bound: float | None) -> float:
    """The factor that brings a delta of L2 ``norm`` within ``bound`` (1 when it is)."""
    return 1.0 if bound is None or norm <= bound else bound / norm


@dataclass(frozen=True)
class Group:
    """Keys that sent one update between them: whoever stands behind them counts that many
    times, so its sensitivity is ``keys * S`` (group privacy)."""

    keys: int
    epsilon_per_round: float
    epsilon: float


@dataclass(frozen=True)
class Privacy:
    """What the report says of the noise a round added and what it cost."""

    settings: DpSettings
    epsilon_per_round: float
    epsilon: float
    """After ``settings.rounds`` rounds (the cumulative figure)."""
    epsilon_replace_one: float
    """Per round, against replacing one device's update (sensitivity 2 S)."""
    weight_total: float
    """sum_k w_k of the updates combined (W expected it)."""
    group: Group | None = None
    """The largest group of keys that sent near-identical updates, when there is one."""

    @property
    def noise_multiplier(self) -> float:
        return self.settings.noise_multiplier

    @property
    def noise_std(self) -> float:
        return self.settings.noise_std


def epsilon(noise_multiplier: float, delta: float, rounds: int) -> float:
    """epsilon after ``rounds`` Gaussian mechanisms with this noise multiplier, at ``delta``."""
    try:
        import dp_accounting
        from dp_accounting import rdp
    except ImportError:  # pragma: no cover - the learn extra is part of dev
        raise UsageError(
            "--dp-noise-multiplier needs the dp-accounting package: pip install -e '.[learn]'"
        ) from None
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(delta))


def account(settings: DpSettings, weights: np.ndarray, group_keys: int = 1) -> Privacy:
    """The round's privacy figures; ``weights`` are the ``w_k / W`` combined, ``group_keys``
    the most keys that sent one near-identical update between them."""
    z, delta, rounds = settings.noise_multiplier, settings.delta, settings.rounds
    group = None
    if group_keys > 1:
        group = Group(group_keys, epsilon(z / group_keys, delta, 1),
                      epsilon(z / group_keys, delta, rounds))
    return Privacy(settings, epsilon(z, delta, 1), epsilon(z, delta, rounds),
                   epsilon(z / 2, delta, 1),
                   float(np.sum(weights)) * settings.expected_weight, group)


def one_per_key(updates: Sequence[Update]) -> tuple[list[int], dict[int, str]]:
    """Under DP a device (its signing key) adds one update a round, or its sensitivity is a
    multiple of S: the indices kept (each key's freshest: lowest staleness, then highest
    signed sequence), and for each index left out, the version kept in its place."""

    def rank(u: Update) -> tuple[int, int]:
        return u.release.staleness, -u.manifest.sequence

    best: dict[str, int] = {}
    for i, u in enumerate(updates):
        j = best.get(u.key.key_id)
        if j is None or rank(u) < rank(updates[j]):
            best[u.key.key_id] = i
    kept = sorted(best.values())
    dropped = {i: updates[best[u.key.key_id]].version for i, u in enumerate(updates)
               if best[u.key.key_id] != i}
    return kept, dropped


class GaussianNoise:
    """Adds N(0, std^2) to each coordinate of the combined delta; keeps the noise's norm."""

    def __init__(self, std: float, rng: np.random.Generator | None = None) -> None:
        self.std = std
        # Seeded from the OS: a noise seed anyone can know would undo the guarantee.
        self.rng = rng or np.random.default_rng()
        self.sum_squares = 0.0

    def add(self, combined: np.ndarray) -> np.ndarray:
        noise = self.rng.normal(0.0, self.std, size=combined.shape)
        self.sum_squares += float(np.dot(noise, noise))
        combined += noise
        return combined
