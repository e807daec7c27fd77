"""Central Gaussian DP on fedavg: the noise the report states, (epsilon, delta) from
dp-accounting, and the option combinations that cannot be honoured (exit 2)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.hpc_core.aggregation.conftest import Result
from tests.support.fleet_registry import FleetRegistry

pytest.importorskip("dp_accounting")  # the learn extra, part of dev


@pytest.fixture
def ten_updates(fleet: FleetRegistry) -> dict:
    rng = np.random.default_rng(3)
    base = {"w": rng.normal(size=(100, 40)).astype(np.float32),
            "frozen": rng.normal(size=(50, 40)).astype(np.float32)}  # no device changes it
    release = fleet.release("1", base)
    fleet.fine_tunes(release, base, [{"w": rng.normal(size=(100, 40)).astype(np.float32)}
                                     for _ in range(10)])
    return base


def test_epsilon_is_finite_and_falls_as_the_noise_grows(
        ten_updates: dict, aggregate: Callable[..., Result]) -> None:
    import dp_accounting
    from dp_accounting import rdp

    plain_run = aggregate("--clip-norm", "2")
    plain = plain_run.tensors["w"]
    assert plain_run.tensors["frozen"].tobytes() == ten_updates["frozen"].tobytes()
    epsilons = []
    for z in (0.5, 1.0, 2.0, 4.0):
        result = aggregate("--clip-norm", "2", "--dp-noise-multiplier", str(z),
                           "--dp-delta", "1e-5")
        assert result.code == 0, result.stderr
        dp = result.report["dp"]
        assert dp["noise_std"] == pytest.approx(z * 2 / 10)  # Z * C / N, equal weights
        assert np.isfinite(dp["epsilon"]) and dp["delta"] == 1e-5 and dp["rounds"] == 1
        accountant = rdp.RdpAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(z), 1)
        assert dp["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
        noise = result.tensors["w"].astype(np.float64) - plain
        assert np.std(noise) == pytest.approx(dp["noise_std"], rel=0.1)  # 4,000 draws
        frozen = result.tensors["frozen"].astype(np.float64) - ten_updates["frozen"]
        assert np.std(frozen) == pytest.approx(dp["noise_std"], rel=0.1)  # noised all the same
        assert dp["noise_norm"] == pytest.approx(
            np.sqrt(np.sum(noise ** 2) + np.sum(frozen ** 2)), rel=1e-3)
        epsilons.append(dp["epsilon"])
    assert epsilons == sorted(epsilons, reverse=True) and len(set(epsilons)) == 4
    more = aggregate("--clip-norm", "2", "--dp-noise-multiplier", "1", "--dp-delta", "1e-5",
                     "--dp-rounds", "10").report["dp"]
    assert more["rounds"] == 10 and more["epsilon"] > epsilons[1]


def test_dp_needs_clipping_fedavg_and_a_delta(ten_updates: dict,
                                              aggregate: Callable[..., Result]) -> None:
    for options, words in (
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5"], "needs --clip-norm"),
        (["--dp-noise-multiplier", "1", "--clip-norm", "1"], "needs --dp-delta"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5", "--clip-norm", "1",
          "--strategy", "median"], "fedavg only"),
        (["--dp-noise-multiplier", "0", "--dp-delta", "1e-5", "--clip-norm", "1"], "> 0"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "2", "--clip-norm", "1"], "(0, 1)"),
    ):
        result = aggregate(*options)
        assert result.code == 2 and words in result.stderr, (options, result.stderr)
        assert not result.out.exists()
