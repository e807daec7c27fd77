"""`hpc-train aggregate` end to end on a folder registry: every strategy against a worked
example and against numpy/scipy on the whole stacked models, clipping, weights, staleness,
and an output that `hpc-train publish` takes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from hpc_core.aggregation.strategies import STRATEGIES
from hpc_core.model_spec import read_checkpoint
from registry.publish import publish_content
from registry.signing import load_signing_key
from tests.hpc_core.aggregation.conftest import (
    HAND_EXPECTED,
    Result,
    hand_deltas,
    reference_krum,
)
from tests.support.fleet_registry import FleetRegistry

ZERO = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_on_the_worked_example(strategy: str, fleet: FleetRegistry,
                                             aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    updates = fleet.fine_tunes(base, ZERO, hand_deltas())
    result = aggregate("--strategy", strategy)
    assert result.code == 0, result.stderr
    for name, want in HAND_EXPECTED[strategy].items():
        np.testing.assert_allclose(result.tensors[name], np.array(want, np.float32), rtol=1e-6)
    report = result.report
    assert report["combined"] == sorted(u.version for u in updates)
    assert report["base"] == {"version": "1", "sequence": base.sequence}
    if strategy == "krum":
        rows = {r["version"]: r for r in report["updates"]}
        assert report["krum"]["chosen"] == updates[3].version
        assert rows[updates[3].version]["distance_to_aggregate"] == 0
        assert rows[updates[2].version]["distance_to_aggregate"] == pytest.approx(76 ** 0.5)


def _random_fleet(fleet: FleetRegistry, n: int, seed: int = 0) -> tuple[dict, list[dict]]:
    """n fine-tunes of a model whose small tensors share 4 KiB chunks, elements split across
    chunk edges included, and a big one spread over several chunks and blocks."""
    fleet.chunk_size = fleet.pack_below = 4096
    rng = np.random.default_rng(seed)
    base = {
        "w": rng.normal(size=(300, 7)).astype(np.float32),  # 8400 B: 3 chunks, 3 blocks
        "a16": rng.normal(size=3).astype(np.float16),  # 6 B: what follows is misaligned
        "b": rng.normal(size=900).astype(np.float32),
        "c": rng.normal(size=500).astype(np.float32),  # straddles the packed chunks' edge
        "steps": np.array([7], dtype=np.int64),  # not averaged: kept from the base
    }
    release = fleet.release("1", base)
    deltas = [{k: rng.normal(size=v.shape).astype(v.dtype) for k, v in base.items()
               if k != "steps"} for _ in range(n)]
    fleet.fine_tunes(release, base, deltas)
    stored = [{k: (v + d[k]).astype(v.dtype) if k in d else v for k, v in base.items()}
              for d in deltas]
    return base, stored


def _stack(base: dict, updates: list[dict], name: str) -> np.ndarray:
    return np.stack([u[name].astype(np.float32) - base[name].astype(np.float32)
                     for u in updates])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_streaming_equals_the_whole_array_reference(strategy: str, fleet: FleetRegistry,
                                                    aggregate: Callable[..., Result]) -> None:
    base, updates = _random_fleet(fleet, n=7)
    extra = {"trimmed-mean": ["--trim", "0.3"], "krum": ["--krum-f", "2"]}.get(strategy, [])
    result = aggregate("--strategy", strategy, "--block-mb", "0.001", *extra)
    assert result.code == 0, result.stderr
    flat = np.concatenate([_stack(base, updates, k).reshape(7, -1) for k in ("w", "b", "c")],
                          axis=1)
    chosen = reference_krum(flat, 2)
    for name in ("w", "a16", "b", "c"):
        d = _stack(base, updates, name)
        combined = {
            "fedavg": d.mean(axis=0),
            "trimmed-mean": stats.trim_mean(d, 0.3, axis=0),
            "median": np.median(d, axis=0),
            "krum": d[chosen],
        }[strategy]
        want = (base[name].astype(np.float32) + combined).astype(base[name].dtype)
        rtol = 1e-3 if name == "a16" else 1e-5
        np.testing.assert_allclose(result.tensors[name], want, rtol=rtol, atol=1e-6)
    assert result.tensors["steps"].tolist() == [7]
    assert result.report["kept_from_base"] == ["steps"]


def test_clipping_reports_norms_before_and_after(fleet: FleetRegistry,
                                                 aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    deltas = [{"w": np.full((2, 3), 1.0, np.float32), "b": np.zeros(2, np.float32)},  # 6**.5
              {"w": np.full((2, 3), 10.0, np.float32), "b": np.zeros(2, np.float32)}]
    fleet.fine_tunes(base, ZERO, deltas)
    result = aggregate("--clip-norm", "4.899")
    assert result.code == 0, result.stderr
    rows = result.report["updates"]
    assert [r["norm"] for r in rows] == pytest.approx([6 ** 0.5, 600 ** 0.5])
    assert [r["clipped_norm"] for r in rows] == pytest.approx([6 ** 0.5, 4.899])
    assert rows[0]["clip_scale"] == 1.0
    # Each clipped to its own norm first, then the mean.
    want = (1.0 + 10.0 * 4.899 / 600 ** 0.5) / 2
    np.testing.assert_allclose(result.tensors["w"], np.full((2, 3), want), rtol=1e-6)


@pytest.mark.parametrize("strategy", ["fedavg", "median", "krum"])
def test_a_server_step_scales_the_combined_delta_not_the_base(
        strategy: str, fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    start = {"w": np.full((2, 3), 0.5, np.float32), "b": np.array([1.0, -1.0], np.float32)}
    base = fleet.release("1", start)
    fleet.fine_tunes(base, start, hand_deltas())
    plain = aggregate("--strategy", strategy)
    stepped = aggregate("--strategy", strategy, "--server-lr", "2.5")
    assert plain.code == 0 and stepped.code == 0, (plain.stderr, stepped.stderr)
    for name, want in HAND_EXPECTED[strategy].items():
        np.testing.assert_allclose(stepped.tensors[name],
                                   start[name] + 2.5 * np.array(want, np.float32), rtol=1e-6)
    # What the report measures is the combined delta's, as without the step.
    assert stepped.report["aggregate_delta_norm"] == pytest.approx(
        plain.report["aggregate_delta_norm"])
    assert [r["distance_to_aggregate"] for r in stepped.report["updates"]] == pytest.approx(
        [r["distance_to_aggregate"] for r in plain.report["updates"]])
    assert stepped.report["params"]["server_lr"] == 2.5


def test_a_server_step_leaves_running_statistics_at_their_mean(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    start = {"conv.weight": np.ones(4, np.float32), "bn.running_var": np.ones(4, np.float32)}
    base = fleet.release("1", start)
    # The devices' variances fell; three times that fall would make them negative.
    fleet.fine_tunes(base, start, [{"conv.weight": np.full(4, d, np.float32),
                                    "bn.running_var": np.full(4, -0.5, np.float32)}
                                   for d in (0.1, 0.3)])
    result = aggregate("--server-lr", "3")
    assert result.code == 0, result.stderr
    np.testing.assert_allclose(result.tensors["conv.weight"], 1 + 3 * 0.2, rtol=1e-6)
    np.testing.assert_allclose(result.tensors["bn.running_var"], 0.5, rtol=1e-6)


def test_fedavg_weights_by_sample_count_when_every_update_has_one(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    deltas = [{"w": np.full((2, 3), v, np.float32), "b": np.zeros(2, np.float32)}
              for v in (1.0, 5.0)]
    fleet.fine_tunes(base, ZERO, deltas, samples=[100, 300])
    result = aggregate()
    assert result.code == 0, result.stderr
    report = result.report
    assert report["weighting"]["by"] == "samples"
    assert report["weighting"]["samples_metric"] == "train/samples"
    assert [r["weight"] for r in report["updates"]] == [0.25, 0.75]
    np.testing.assert_allclose(result.tensors["w"], np.full((2, 3), 0.25 + 3.75))
    # One more update without a count: every update weighs the same.
    fleet.fine_tunes(base, ZERO, [{"w": np.full((2, 3), 3.0, np.float32)}], prefix="other")
    result = aggregate()
    assert result.report["weighting"]["by"] == "equal"
    np.testing.assert_allclose(result.tensors["w"], np.full((2, 3), 3.0))


def test_stale_updates_are_taken_against_their_release_and_discounted(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    one = fleet.release("1", ZERO)
    base_two = {"w": np.full((2, 3), 100.0, np.float32), "b": np.ones(2, np.float32)}
    two = fleet.release("2", base_two, parent=one)
    step = {"w": np.full((2, 3), 2.0, np.float32), "b": np.zeros(2, np.float32)}
    stale = fleet.fine_tunes(one, ZERO, [step], prefix="old")[0]
    fresh = fleet.fine_tunes(two, base_two, [step, step], prefix="new")

    result = aggregate(base="2")  # --max-staleness 0: the fine-tune of 1 is not this round's
    assert result.code == 0, result.stderr
    assert result.report["combined"] == sorted(u.version for u in fresh)
    assert result.report["ignored"] == {
        "trained from a release outside --max-staleness": 1, "upstream release": 1}

    result = aggregate("--max-staleness", "1", base="2")
    assert result.code == 0, result.stderr
    rows = {r["version"]: r for r in result.report["updates"]}
    assert rows[stale.version]["staleness"] == 1 and rows[stale.version]["release"] == "1"
    assert rows[stale.version]["staleness_scale"] == pytest.approx(2 ** -0.5)
    assert rows[fresh[0].version]["staleness_scale"] == 1.0
    # The stale delta is +2 against release 1 (not -98 against 2), then times 1/sqrt(2).
    want = 100.0 + (2.0 + 2.0 + 2.0 * 2 ** -0.5) / 3
    np.testing.assert_allclose(result.tensors["w"], np.full((2, 3), want), rtol=1e-6)
    assert [r["version"] for r in result.report["lineage"]] == ["2", "1"]


def test_the_output_is_a_checkpoint_hpc_train_publish_takes(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    fleet.fine_tunes(base, ZERO, hand_deltas())
    result = aggregate("--strategy", "median")
    assert result.code == 0, result.stderr
    content = read_checkpoint(result.out)  # what `hpc-train publish` reads
    assert content.model == base.model
    assert content.training.metrics["aggregate/updates"] == 5
    key = load_signing_key(fleet.work / "keys" / "upstream.key.pem")
    published = publish_content(content, fleet.store, name=fleet.name, version="2",
                                key=key, parent="1").manifest
    assert published.parent == "1" and published.base is None
    assert {t.name: (t.dtype, t.shape) for t in published.tensors} == {
        t.name: (t.dtype, t.shape) for t in base.tensors}
    # Nothing is left beside --out but --out itself.
    assert sorted(p.name for p in result.out.parent.iterdir()
                  if p.name.startswith((".tmp-", "aggregate-"))) == [result.out.name]


def test_help_teaches_and_hpc_train_has_the_command(capsys: pytest.CaptureFixture) -> None:
    from hpc_core.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["aggregate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in ("examples:", "exit codes: 0 written; 1 too few", "--updates auto",
                   "train/samples", "1 / (1 + staleness) ** 0.5", "krum", "dp-accounting"):
        assert needle in text


def test_bad_arguments_exit_2_before_reading_anything(tmp_path: Path,
                                                      aggregate: Callable[..., Result]) -> None:
    for options in (["--strategy", "mean"], ["--trim", "0.6", "--strategy", "trimmed-mean"],
                    ["--trim", "0.1"], ["--krum-f", "1"], ["--krum-keep", "2"],
                    ["--strategy", "krum", "--krum-keep", "0"], ["--clip-norm", "-1"],
                    ["--clip-norm", "mean"], ["--clip-norm", "0"],
                    ["--updates", "../x"], ["--dp-delta", "1e-5"], ["--server-lr", "0"],
                    ["--server-lr", "nan"], ["--server-lr", "1000"]):
        result = aggregate(*options)
        assert result.code == 2, (options, result.stderr)
        assert not result.out.exists()


def test_a_head_only_fine_tune_leaves_the_body_bitwise_alone(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    fleet.chunk_size = 4096
    rng = np.random.default_rng(5)
    base = {"body": rng.normal(size=(64, 64)).astype(np.float32),
            "head": rng.normal(size=(10, 64)).astype(np.float32)}
    release = fleet.release("1", base)
    heads = [{"head": rng.normal(size=(10, 64)).astype(np.float32)} for _ in range(3)]
    fleet.fine_tunes(release, base, heads)
    result = aggregate("--strategy", "median")
    assert result.code == 0, result.stderr
    assert result.tensors["body"].tobytes() == base["body"].tobytes()
    want = base["head"] + np.median([(base["head"] + h["head"]) - base["head"] for h in heads],
                                    axis=0)
    np.testing.assert_allclose(result.tensors["head"], want, rtol=1e-6)
