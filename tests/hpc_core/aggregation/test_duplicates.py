"""Near-identical updates (equal delta norms within 1e-6, cosine >= 0.9999): found from the
norms first, confirmed on the Gram matrix, reported as groups and kept."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hpc_core.aggregation.duplicates import near_identical, norm_candidates
from tests.hpc_core.aggregation.conftest import Result
from tests.support.fleet_registry import FleetRegistry


def test_candidates_are_norms_within_the_tolerance_of_another() -> None:
    norms = [1.0, 2.0, 1.0 + 5e-7, 3.0, 0.0, 0.0, 2.0 * (1 + 2e-6)]
    assert norm_candidates(norms) == [0, 2]  # zeros change nothing; 2e-6 apart is too far


def test_groups_need_both_the_norm_and_the_cosine() -> None:
    rng = np.random.default_rng(1)
    a = rng.normal(size=1000)
    turned = a.copy()
    turned[:2] = turned[1::-1]  # a permutation: the same norm, another direction
    close = a + 1e-3 * rng.normal(size=1000)
    close *= np.linalg.norm(a) / np.linalg.norm(close)  # cosine ~0.9999995, equal norm
    rows = np.stack([a, a, close, turned, -a])
    norms = [float(np.linalg.norm(r)) for r in rows]
    groups = near_identical(norms, rows @ rows.T, list(range(5)), ["k0", "k1", "k2", "k3", "k4"])
    (group,) = groups
    assert group.members == [0, 1, 2] and group.keys == 3
    assert 0.9999 <= group.min_cosine < 1.0 and group.norm_spread < 1e-12
    # The same key twice is still a group, of one key.
    (same_key,) = near_identical(norms, rows @ rows.T, [0, 1], ["k0", "k0", "", "", ""])
    assert same_key.keys == 1


def test_two_identical_poisoned_updates_are_flagged_and_still_combined(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    rng = np.random.default_rng(7)
    base = {"w": rng.normal(size=(64, 32)).astype(np.float32)}
    release = fleet.release("1", base)
    honest = [{"w": (0.01 * rng.normal(size=(64, 32))).astype(np.float32)} for _ in range(5)]
    bad = {"w": (-0.5 * honest[0]["w"]).astype(np.float32)}
    fleet.fine_tunes(release, base, [*honest, bad, bad])
    for strategy in ("fedavg", "median"):
        result = aggregate("--strategy", strategy)
        assert result.code == 0, result.stderr
        (group,) = result.report["duplicates"]["groups"]
        assert [v.split("+")[1].split(".")[0] for v in group["versions"]] == ["dev-5", "dev-6"]
        assert len(group["keys"]) == 2 and "kept and flagged" in \
            result.report["duplicates"]["action"]
        assert len(result.report["combined"]) == 7
        assert "WARNING near-identical updates under 2 key(s)" in result.stdout
    plain = aggregate()
    weights = [row["weight"] for row in plain.report["updates"]]
    assert weights == [weights[0]] * 7  # each key keeps its weight
