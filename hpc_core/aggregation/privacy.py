"""Central differential privacy for fedavg: Gaussian noise on the combined delta, and its cost.

The mechanism is DP-FedAvg's (McMahan et al. 2018, "Learning differentially private recurrent
language models"): every update's delta is clipped to L2 norm C, the weighted mean is taken
with public weights w_i (summing to 1, the denominator fixed), and Gaussian noise of standard
deviation ``Z * C * max_i w_i`` is added to every coordinate of the mean. Adding or removing
one device's update moves the mean by at most ``C * max_i w_i`` in L2, so this is the
Gaussian mechanism with noise multiplier Z under add-or-remove-one-device adjacency; with
equal weights the std is ``Z * C / N``. A stale update's discount (< 1) only shrinks its
contribution. Robust strategies (trimmed mean, median, Krum) have no such simple sensitivity
bound, so DP is refused with them.

(epsilon, delta) comes from Google's ``dp-accounting`` package (the accountant TensorFlow
Privacy and the DP libraries build on; kept up, numpy/scipy only, no ML framework): its Rényi
DP accountant composed over ``rounds`` releases of the same mechanism, without any
amplification by sampling (every selected device takes part in a round). It is imported only
when DP is asked for; it ships in the ``learn`` extra (``pip install -e .[learn]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


@dataclass(frozen=True)
class DpSettings:
    noise_multiplier: float
    """Z: noise std over the sensitivity."""
    delta: float
    """delta of the (epsilon, delta) guarantee; keep it below 1 / (number of devices)."""
    rounds: int
    """Rounds of aggregation the accountant composes (each with this Z)."""
    clip_norm: float
    """C: every update's delta is clipped to this L2 norm first."""


@dataclass(frozen=True)
class Privacy:
    """What the report says of the noise a round added and what it cost."""

    noise_multiplier: float
    noise_std: float
    delta: float
    epsilon: float
    rounds: int


def noise_std(settings: DpSettings, weights: np.ndarray) -> float:
    """``Z * C * max_i w_i`` for weights summing to 1 (``Z * C / N`` when equal)."""
    return settings.noise_multiplier * settings.clip_norm * float(np.max(weights))


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
