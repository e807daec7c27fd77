"""Every strategy of `hpc-train aggregate` against Flower's own aggregate functions
(``flwr.server.strategy.aggregate``, a test-only dependency): the same signed device models,
held whole in memory and combined as Flower combines them, against ours verified and streamed
block by block from the registry. Flower combines weights, we combine deltas from the base and
add the base back: for every strategy here the two are the same function."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.server.strategy import aggregate as flower

from tests.hpc_core.aggregation.conftest import Result
from tests.support.fleet_registry import FleetRegistry

N = 9
FLOAT_TENSORS = ("w", "b", "c")
SAMPLES = [40.0, 120.0, 75.0, 300.0, 10.0, 64.0, 64.0, 200.0, 33.0]


def _fleet(fleet: FleetRegistry) -> list[list[np.ndarray]]:
    """N fine-tunes with unlike sample counts and two outliers (x 30, sign-flipped), over
    small chunks so that tensors straddle chunk edges and blocks; each device's float tensors
    as Flower's ``NDArrays``."""
    fleet.chunk_size = fleet.pack_below = 4096
    rng = np.random.default_rng(7)
    base = {
        "w": rng.normal(size=(300, 7)).astype(np.float32),
        "b": rng.normal(size=900).astype(np.float32),
        "c": rng.normal(size=500).astype(np.float32),
        "steps": np.array([7], dtype=np.int64),  # not combined by us; left out of Flower's
    }
    release = fleet.release("1", base)
    deltas = [{k: rng.normal(scale=0.1, size=base[k].shape).astype(np.float32)
               for k in FLOAT_TENSORS} for _ in range(N)]
    for k in FLOAT_TENSORS:
        deltas[0][k] *= 30.0
        deltas[1][k] *= -1.0
    fleet.fine_tunes(release, base, deltas, samples=list(SAMPLES))
    return [[(base[k] + d[k]).astype(np.float32) for k in FLOAT_TENSORS] for d in deltas]


def _compare(result: Result, want: list[np.ndarray]) -> None:
    assert result.code == 0, result.stderr
    for name, expected in zip(FLOAT_TENSORS, want, strict=True):
        np.testing.assert_allclose(result.tensors[name], expected, rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    assert result.tensors["steps"].tolist() == [7]


@pytest.mark.parametrize("trim", [0.1, 0.2, 0.3, 0.45])
def test_trimmed_mean_equals_flowers(trim: float, fleet: FleetRegistry,
                                     aggregate: Callable[..., Result]) -> None:
    models = _fleet(fleet)
    want = flower.aggregate_trimmed_avg([(m, 1) for m in models], proportiontocut=trim)
    _compare(aggregate("--strategy", "trimmed-mean", "--trim", str(trim), "--block-mb", "0.001"),
             want)


def test_fedavg_weighted_by_samples_equals_flowers(fleet: FleetRegistry,
                                                   aggregate: Callable[..., Result]) -> None:
    models = _fleet(fleet)
    result = aggregate("--strategy", "fedavg", "--block-mb", "0.001")
    assert result.report["weighting"]["by"] == "samples"
    # Flower's num_examples is an int; these counts are whole numbers.
    _compare(result, flower.aggregate([(m, int(s)) for m, s in zip(models, SAMPLES, strict=True)]))


def test_median_equals_flowers(fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    models = _fleet(fleet)
    _compare(aggregate("--strategy", "median", "--block-mb", "0.001"),
             flower.aggregate_median([(m, 1) for m in models]))


@pytest.mark.parametrize("f", [1, 2, 3])
def test_krum_chooses_the_device_flower_chooses(f: int, fleet: FleetRegistry,
                                                aggregate: Callable[..., Result]) -> None:
    models = _fleet(fleet)
    want = flower.aggregate_krum([(m, 1) for m in models], num_malicious=f, to_keep=0)
    chosen = [i for i, m in enumerate(models)
              if all(np.array_equal(a, b) for a, b in zip(m, want, strict=True))]
    assert len(chosen) == 1 and chosen[0] > 1  # Flower's choice is one honest device
    result = aggregate("--strategy", "krum", "--krum-f", str(f), "--block-mb", "0.001")
    _compare(result, want)
    rows = {r["version"]: r for r in result.report["updates"]}
    assert rows[result.report["krum"]["chosen"]]["distance_to_aggregate"] == 0


@pytest.mark.parametrize(("f", "keep"), [(1, 5), (2, 7), (3, 4)])
def test_multi_krum_equals_flowers(f: int, keep: int, fleet: FleetRegistry,
                                   aggregate: Callable[..., Result]) -> None:
    models = _fleet(fleet)
    # Flower averages the kept models by their example counts, as fedavg does.
    want = flower.aggregate_krum([(m, int(s)) for m, s in zip(models, SAMPLES, strict=True)],
                                 num_malicious=f, to_keep=keep)
    result = aggregate("--strategy", "krum", "--krum-f", str(f), "--krum-keep", str(keep),
                       "--block-mb", "0.001")
    _compare(result, want)
    kept = result.report["krum"]["kept"]
    rows = {r["version"]: r for r in result.report["updates"]}
    assert len(kept) == keep and kept[0] == result.report["krum"]["chosen"]
    assert sorted(r["chosen"] for r in rows.values()) == [False] * (N - keep) + [True] * keep
    # The x 30 one is never kept (the flipped one is just another random delta here).
    assert not [r for r in rows.values() if r["samples"] == SAMPLES[0] and r["chosen"]]
    kept_w = [rows[v]["weight"] for v in kept]
    assert sum(kept_w) == pytest.approx(1.0)
    assert kept_w == pytest.approx([s / sum(rows[v]["samples"] for v in kept)
                                    for s in (rows[v]["samples"] for v in kept)])
