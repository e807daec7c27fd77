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
                           "--dp-delta", "1e-5", "--dp-expected-weight", "10")
        assert result.code == 0, result.stderr
        dp = result.report["dp"]
        assert dp["noise_std"] == pytest.approx(z * 2 / 10)  # Z * C / W, W = the 10 updates
        assert dp["sensitivity"] == pytest.approx(2 / 10) and dp["sampling_rate"] == 1.0
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
                     "--dp-rounds", "10", "--dp-expected-weight", "10").report["dp"]
    assert more["rounds"] == 10 and more["epsilon"] > epsilons[1]
    assert more["epsilon_per_round"] == pytest.approx(epsilons[1])


def test_dp_needs_clipping_fedavg_and_a_delta(ten_updates: dict,
                                              aggregate: Callable[..., Result]) -> None:
    W = ["--dp-expected-weight", "10"]  # the estimator's expected weight
    for options, words in (
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5", *W], "needs --clip-norm"),
        (["--dp-noise-multiplier", "1", "--clip-norm", "1", *W], "needs --dp-delta"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5", "--clip-norm", "1", *W,
          "--strategy", "median"], "fedavg only"),
        (["--dp-noise-multiplier", "0", "--dp-delta", "1e-5", "--clip-norm", "1", *W], "> 0"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "2", "--clip-norm", "1", *W], "(0, 1)"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5", "--clip-norm", "median", *W],
         "needs a fixed --clip-norm C"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5", "--clip-norm", "1"],
         "needs --dp-expected-weight"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5", "--clip-norm", "1",
          "--dp-expected-weight", "0"], "--dp-expected-weight 0.0: the total weight"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "1e-5", "--clip-norm", "1", *W,
          "--dp-weight-cap", "-3"], "--dp-weight-cap -3.0"),
        (["--clip-norm", "1", *W], "go with --dp-noise-multiplier"),
    ):
        result = aggregate(*options)
        assert result.code == 2 and words in result.stderr, (options, result.stderr)
        assert not result.out.exists()


def test_running_statistics_keep_the_base_under_dp_and_count_for_nothing_in_the_clip(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    # Noise on a running variance can make it negative (NaN in every forward pass after it),
    # and the statistics are averages of the device's own samples, which the clip does not
    # bound: under DP they stay at the base's values; without DP they are combined as before.
    rng = np.random.default_rng(5)
    base = {"conv.weight": rng.normal(size=(40, 10)).astype(np.float32),
            "bn.running_mean": np.zeros(40, dtype=np.float32),
            "bn.running_var": np.full(40, 1e-3, dtype=np.float32)}
    release = fleet.release("1", base)
    # The devices move the statistics far (norm ~ 600) and the weights a little (norm ~ 2).
    fleet.fine_tunes(release, base, [
        {"conv.weight": rng.normal(scale=0.1, size=(40, 10)).astype(np.float32),
         "bn.running_mean": rng.normal(scale=100.0, size=40).astype(np.float32),
         "bn.running_var": np.full(40, 5.0, dtype=np.float32)}  # deltas on the base
        for _ in range(10)])
    plain = aggregate()
    assert plain.code == 0, plain.stderr
    assert np.allclose(plain.tensors["bn.running_var"], 5.001)  # combined like any tensor
    private = aggregate("--clip-norm", "100", "--dp-noise-multiplier", "1", "--dp-delta", "1e-5",
                        "--dp-expected-weight", "10")
    assert private.code == 0, private.stderr
    assert private.tensors["bn.running_var"].tobytes() == base["bn.running_var"].tobytes()
    assert private.tensors["bn.running_mean"].tobytes() == base["bn.running_mean"].tobytes()
    # The weights' deltas (norm ~2 < 100) were not clipped: the statistics' ~600 did not count.
    rows = private.report["updates"]
    assert all(row["clip_scale"] == 1.0 and row["norm"] < 5 for row in rows), rows
    assert all(row["norm"] > 100 for row in plain.report["updates"])  # there they count
    noise = private.tensors["conv.weight"].astype(np.float64) - plain.tensors["conv.weight"]
    assert np.std(noise) == pytest.approx(private.report["dp"]["noise_std"], rel=0.15)


def test_dp_weights_are_capped_and_over_the_expected_weight_not_the_turnout() -> None:
    from hpc_core.aggregation.privacy import DpSettings, clip_scale, device_weights, dp_weights

    assert device_weights([10.0, 200.0, 1e9, None], cap=100.0).tolist() == [0.1, 1.0, 1.0, 1.0]
    assert device_weights([10.0, 1e9, None], cap=None).tolist() == [1.0, 1.0, 1.0]
    dp = DpSettings(noise_multiplier=2.0, delta=1e-5, rounds=3, clip_norm=4.0,
                    expected_weight=8.0, weight_cap=100.0)
    weights, how = dp_weights([50.0, 1e9, None], dp)
    # Three updates where eight were expected: the weights do not grow to sum to 1.
    assert weights.tolist() == [0.5 / 8, 1 / 8, 1 / 8] and "expected weight 8" in how
    assert dp.sensitivity == 0.5 and dp.noise_std == 1.0  # C / W and z x that
    assert clip_scale(8.0, 4.0) == 0.5 and clip_scale(3.0, 4.0) == 1.0
    assert clip_scale(3.0, None) == 1.0


def test_dp_counts_one_update_per_device_key_a_round(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    rng = np.random.default_rng(9)
    base = {"w": rng.normal(size=(30, 20)).astype(np.float32)}
    release = fleet.release("1", base)
    fleet.fine_tunes(release, base, [{"w": rng.normal(size=(30, 20)).astype(np.float32)}
                                     for _ in range(3)])
    key = fleet.device("dev-0")  # dev-0 uploads twice in the round: 2 x its share under DP
    again = fleet.update(key, release, {"w": base["w"] + 1})
    plain = aggregate()
    assert plain.code == 0 and len(plain.report["combined"]) == 4  # without DP: as before
    private = aggregate("--clip-norm", "1", "--dp-noise-multiplier", "1", "--dp-delta", "1e-5",
                        "--dp-expected-weight", "3")
    assert private.code == 0, private.stderr
    assert len(private.report["combined"]) == 3 and again.version in private.report["combined"]
    (skip,) = private.report["skipped"]
    assert "+dev-0." in skip["version"] and skip["version"] != again.version
    assert f"another update signed by dev-0 is combined, {again.version}" in skip["reason"]
    dp = private.report["dp"]
    assert dp["weight_total"] == 3 and dp["expected_weight"] == 3
    assert [row["weight"] for row in private.report["updates"]] == [pytest.approx(1 / 3)] * 3
