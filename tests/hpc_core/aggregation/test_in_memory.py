"""The in-memory combination equals ``hpc-train aggregate`` on the same updates: each rule run
through the CLI on a real folder registry of signed uploads, and through ``combine_updates``
on the stacked deltas."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hpc_core.aggregation.in_memory import Rule, combine_updates
from hpc_core.aggregation.privacy import DpSettings
from tests.hpc_core.aggregation.conftest import Result, reference_multi_krum
from tests.support.fleet_registry import FleetRegistry

N = 7
SAMPLES = [40.0, 10.0, 25.0, 60.0, 5.0, 33.0, 12.0]
NAMES = ("w", "b")


def _fleet(fleet: FleetRegistry, samples: list[float] | None = SAMPLES
           ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, float | None]]:
    """N uploads of a 40x30 weight and a bias, one of them far out; the base and, by
    version, each update's delta and sample count."""
    rng = np.random.default_rng(4)
    base = {"w": rng.normal(size=(40, 30)).astype(np.float32),
            "b": rng.normal(size=30).astype(np.float32)}
    release = fleet.release("1", base)
    deltas = [{k: (rng.normal(size=v.shape) * (20.0 if i == 4 else 1.0)).astype(np.float32)
               for k, v in base.items()} for i in range(N)]
    made = fleet.fine_tunes(release, base, deltas, samples=samples)
    # what the registry holds: base + delta in float32, so the delta read back is this
    by_version = {m.version: np.concatenate([((base[k] + d[k]).astype(np.float32)
                                              - base[k]).ravel() for k in NAMES])
                  for m, d in zip(made, deltas, strict=True)}
    counts = {m.version: samples[i] if samples else None for i, m in enumerate(made)}
    return base, by_version, counts


def _step(result: Result, base: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([(result.tensors[k] - base[k]).ravel() for k in NAMES]
                          ).astype(np.float64)


CASES: dict[str, tuple[list[str], Rule]] = {
    "fedavg": ([], Rule()),
    "trimmed-mean": (["--strategy", "trimmed-mean", "--trim", "0.3"],
                     Rule("trimmed-mean", trim=0.3)),
    "median": (["--strategy", "median"], Rule("median")),
    "krum": (["--strategy", "krum", "--krum-f", "2"], Rule("krum", krum_f=2)),
    "multi-krum": (["--strategy", "krum", "--krum-f", "1", "--krum-keep", "4"],
                   Rule("krum", krum_f=1, krum_keep=4)),
    "fedavg-median-clip": (["--clip-norm", "median"], Rule(clip_norm="median")),
    "fedavg-clip-server-lr": (["--clip-norm", "30", "--server-lr", "1.7"],
                              Rule(clip_norm=30.0, server_lr=1.7)),
    "median-clip-trimmed": (["--strategy", "trimmed-mean", "--clip-norm", "median"],
                            Rule("trimmed-mean", clip_norm="median")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rule_equals_hpc_train_aggregate(case: str, fleet: FleetRegistry,
                                              aggregate: Callable[..., Result]) -> None:
    base, deltas, counts = _fleet(fleet)
    argv, rule = CASES[case]
    result = aggregate(*argv)
    assert result.code == 0, result.stderr
    order = [row["version"] for row in result.report["updates"]]
    stacked = np.stack([deltas[v] for v in order])
    samples = [counts[v] for v in order]
    got = combine_updates(stacked, samples, rule)
    np.testing.assert_allclose(got, _step(result, base), rtol=1e-5, atol=2e-6)
    if case == "multi-krum":  # and both equal the definition
        want = reference_multi_krum(stacked, 1, 4, samples)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dp_equals_hpc_train_aggregate_up_to_its_noise(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base, deltas, _ = _fleet(fleet, samples=None)
    dp = DpSettings(noise_multiplier=1e-3, delta=1e-5, rounds=1, clip_norm=3.0,
                    expected_weight=10.0)
    result = aggregate("--clip-norm", "3", "--dp-noise-multiplier", "1e-3", "--dp-delta",
                       "1e-5", "--dp-expected-weight", "10")
    assert result.code == 0, result.stderr
    stacked = np.stack([deltas[row["version"]] for row in result.report["updates"]])
    got = combine_updates(stacked, [None] * N, Rule(clip_norm=3.0, dp=dp),
                          rng=np.random.default_rng(0))
    # noise sd 3e-4 each side: the fixed denominator (sum / 10, not / 7) is what is compared
    np.testing.assert_allclose(got, _step(result, base), atol=3e-3)
    noiseless = combine_updates(stacked, [None] * N, Rule(clip_norm=3.0))
    assert np.abs(got - noiseless * N / 10).max() < 3e-3
    assert np.abs(got - noiseless).max() > 0.01


def test_non_finite_updates_are_left_out_and_too_few_refused() -> None:
    rows = np.array([[1.0, 2.0], [3.0, 4.0], [np.nan, 0.0], [np.inf, 1.0]])
    np.testing.assert_allclose(combine_updates(rows, [1, 3, 100, 100], Rule()), [2.5, 3.5])
    with pytest.raises(ValueError, match="2 finite updates; krum needs 5"):
        combine_updates(rows, [None] * 4, Rule("krum", krum_f=1))
    with pytest.raises(ValueError, match="one row, count and staleness per update"):
        combine_updates(rows, [None] * 3, Rule())
    with pytest.raises(ValueError, match="fedavg with a fixed clip_norm only"):
        combine_updates(rows, [None] * 4, Rule("median", dp=DpSettings(1.0, 1e-5, 1, 1.0, 4)))
    with pytest.raises(ValueError, match="one row, count and staleness per update"):
        combine_updates(rows, [None] * 4, Rule(), staleness=[0, 1])
    with pytest.raises(ValueError, match="releases behind the base, 0 or more"):
        combine_updates(rows, [None] * 4, Rule(), staleness=[0, 0, 0, -1])


STALE_CASES: dict[str, tuple[list[str], Rule]] = {
    "fedavg": ([], Rule()),
    "fedavg-median-clip": (["--clip-norm", "median"], Rule(clip_norm="median")),
    "trimmed-mean": (["--strategy", "trimmed-mean", "--trim", "0.2"],
                     Rule("trimmed-mean", trim=0.2)),
}


@pytest.mark.parametrize("case", list(STALE_CASES))
def test_late_updates_are_discounted_as_hpc_train_aggregate_does(
        case: str, fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    # Releases 1 <- 2 <- 3; the round's base is 3. Three fresh fine-tunes of 3, a late one of
    # 2 (staleness 1) and one of 1 (staleness 2), each delta against its own release.
    rng = np.random.default_rng(9)
    bases, releases = [], []
    for v in ("1", "2", "3"):
        bases.append({k: rng.normal(size=s).astype(np.float32)
                      for k, s in (("w", (40, 30)), ("b", (30,)))})
        releases.append(fleet.release(v, bases[-1], parent=releases[-1] if releases else None))
    plan = [(2, 0), (2, 0), (2, 0), (1, 1), (0, 2)]  # (release index, staleness)
    made, rows, samples = [], {}, {}
    for i, (r, _) in enumerate(plan):
        delta = {k: (rng.normal(size=v.shape) * (1 + i)).astype(np.float32)
                 for k, v in bases[r].items()}
        m = fleet.fine_tunes(releases[r], bases[r], [delta], samples=[10.0 + 7 * i],
                             prefix=f"dev{i}")[0]
        made.append(m)
        rows[m.version] = np.concatenate([((bases[r][k] + delta[k]).astype(np.float32)
                                           - bases[r][k]).ravel() for k in NAMES])
        samples[m.version] = 10.0 + 7 * i
    argv, rule = STALE_CASES[case]
    result = aggregate("--max-staleness", "2", *argv, base="3")
    assert result.code == 0, result.stderr
    report = {r["version"]: r for r in result.report["updates"]}
    order = list(report)
    assert sorted(order) == sorted(m.version for m in made)
    staleness = [report[v]["staleness"] for v in order]
    assert sorted(staleness) == [0, 0, 0, 1, 2]
    got = combine_updates(np.stack([rows[v] for v in order]), [samples[v] for v in order],
                          rule, staleness=staleness)
    np.testing.assert_allclose(got, _step(result, bases[2]), rtol=1e-5, atol=2e-6)
    # and the discount is what changed it: the same rows taken as fresh differ
    fresh = combine_updates(np.stack([rows[v] for v in order]), [samples[v] for v in order],
                            rule)
    assert np.abs(fresh - got).max() > 1e-2
