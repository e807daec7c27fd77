"""DP in fleet learning holds what it reports: one device moves the pre-noise aggregate by at
most the sensitivity S the accountant is given; the old renormalizing estimator did not; and
one update replayed under several device keys is flagged.

The estimator is checked twice: from its pieces the aggregation runs (the clip, the weights,
the fedavg kernel) on model-shaped updates for every N from 2 to 10, and end to end through
``hpc-train aggregate`` on a signed registry, with the noise switched off to read the
pre-noise aggregate (the noise is Gaussian of the stated std: ``test_privacy.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from hpc_core.aggregation.command import register_cli
from hpc_core.aggregation.privacy import DpSettings, GaussianNoise, clip_scale, dp_weights
from hpc_core.aggregation.strategies import combine_block, fedavg_weights
from tests.support.fleet_registry import FleetRegistry

dp_accounting = pytest.importorskip("dp_accounting")  # the learn extra, part of dev
from dp_accounting import rdp  # noqa: E402

C = 1.5
"""The clip norm."""
HUGE = 1e7
"""A sample count no device has: one claiming it would outweigh the fleet."""
SHAPES = {"conv1.weight": (16, 3, 3, 3), "conv1.bias": (16,), "conv2.weight": (32, 16, 3, 3),
          "bn.weight": (32,), "bn.bias": (32,), "fc.weight": (10, 128), "fc.bias": (10,)}
Tensors = dict[str, np.ndarray]


def rdp_epsilon(z: float, delta: float = 1e-5, rounds: int = 1) -> float:
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(z), rounds)
    return float(accountant.get_epsilon(delta))


def flat(tensors: Tensors) -> np.ndarray:
    return np.concatenate([tensors[k].ravel() for k in SHAPES]).astype(np.float64)


def device_updates(rng: np.random.Generator, n: int) -> tuple[list[Tensors], list[float]]:
    """``n`` fine-tunes' deltas: a shared direction plus each device's own part, norms from
    well under to several times C, and sample counts from 40 to one device's HUGE."""
    truth = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    truth_norm = np.linalg.norm(flat(truth))
    deltas = []
    for i in range(n):
        own = {k: truth[k] + 0.6 * rng.normal(size=s) for k, s in SHAPES.items()}
        length = C * (0.3 + 3.0 * i / max(n - 1, 1)) / truth_norm
        deltas.append({k: (v * length).astype(np.float32) for k, v in own.items()})
    samples = [float(rng.integers(40, 400)) for _ in range(n)]
    samples[n // 2] = HUGE
    return deltas, samples


def clipped_stack(deltas: list[Tensors]) -> np.ndarray:
    """The N x params float32 block the aggregation stacks: each delta times its clip scale
    (``Deltas.stack``), the scale from the update's L2 norm over every tensor."""
    block = np.stack([flat(d) for d in deltas]).astype(np.float32)
    scales = [clip_scale(float(np.linalg.norm(row.astype(np.float64))), C) for row in block]
    return block * np.array(scales, dtype=np.float32)[:, None]


def dp_aggregate(deltas: list[Tensors], samples: list[float | None],
                 dp: DpSettings) -> np.ndarray:
    """The pre-noise aggregate under DP, as the round computes it."""
    weights, _ = dp_weights(samples, dp)
    return combine_block("fedavg", clipped_stack(deltas), weights=weights, trim=0.0)


def renormalized_aggregate(deltas: list[Tensors], samples: list[float | None]) -> np.ndarray:
    """The estimator DP used to run on: the sample-weighted mean, weights summing to 1."""
    weights, _ = fedavg_weights(samples)
    return combine_block("fedavg", clipped_stack(deltas), weights=weights, trim=0.0)


def worst_case(aggregate: np.ndarray) -> Tensors:
    """A device that pulls straight against the aggregate, 5 C long before clipping."""
    direction = -aggregate / np.linalg.norm(aggregate)
    out, at = {}, 0
    for k, s in SHAPES.items():
        size = int(np.prod(s))
        out[k] = (5 * C * direction[at:at + size]).reshape(s).astype(np.float32)
        at += size
    return out


def neighbours(deltas: list[Tensors], samples: list[float | None], estimate: Callable[
        [list[Tensors], list[float | None]], np.ndarray],
) -> Iterator[tuple[str, float, list[float | None]]]:
    """(case, L2 move of the aggregate, the sample counts of the round WITH the device) for
    each device removed in turn and for a worst-case device (full weight) added."""
    full = estimate(deltas, samples)
    for k in range(len(deltas)):
        rest = estimate(deltas[:k] + deltas[k + 1:], samples[:k] + samples[k + 1:])
        yield f"remove {k}", float(np.linalg.norm(full - rest)), samples
    grown = [*samples, HUGE if samples[0] is not None else None]
    added = estimate([*deltas, worst_case(full)], grown)
    yield "add worst case", float(np.linalg.norm(added - full)), grown


@pytest.mark.parametrize("cap", [None, 200.0], ids=["equal-weights", "cap-200-samples"])
def test_one_device_moves_the_dp_aggregate_by_at_most_the_sensitivity_for_2_to_10_devices(
        cap: float | None) -> None:
    rng = np.random.default_rng(20261126)
    tight = 0.0
    for n in range(2, 11):
        deltas, samples = device_updates(rng, n)
        dp = DpSettings(noise_multiplier=1.1, delta=1e-5, rounds=1, clip_norm=C,
                        expected_weight=n, weight_cap=cap)
        assert dp.sensitivity == pytest.approx(C / n)
        for case, move, _ in neighbours(deltas, samples,
                                        lambda d, s, dp=dp: dp_aggregate(d, s, dp)):
            # float32 sums carry ~1e-7 relative error: the bound is exact arithmetic's.
            assert move <= dp.sensitivity * (1 + 1e-5), (n, cap, case, move, dp.sensitivity)
            tight = max(tight, move / dp.sensitivity)
    # The bound is reached (a clipped full-weight device removed or added): not vacuous.
    assert tight > 0.999


def test_the_renormalizing_estimator_breaks_the_bound_it_was_noised_for() -> None:
    # What DP ran before: the sample-weighted mean, noised for C * max(w). Removing or adding
    # a device also rescales every other device's weight, so it moves up to 2 C w_k / sum w.
    rng = np.random.default_rng(20261126)
    worst = 0.0
    for n in range(2, 11):
        deltas, samples = device_updates(rng, n)
        for given in (samples, [None] * n):  # by sample count, and equal weights (C / N)
            for _, move, with_device in neighbours(deltas, given, renormalized_aggregate):
                w, _ = fedavg_weights(with_device)
                worst = max(worst, move / (C * float(np.max(w))))
    assert worst > 1.9, worst  # the check that holds for the DP estimator fails here
    # What that does to the guarantee at z = 1.1: the noise is z C max(w), the sensitivity
    # up to ~2 C max(w), so the true noise multiplier is ~z / 2: epsilon ~9.5, not ~4.2.
    assert rdp_epsilon(1.1) == pytest.approx(4.24, abs=0.01)
    assert rdp_epsilon(1.1 / worst) > 9.0
    assert rdp_epsilon(1.1 / 2) == pytest.approx(9.55, abs=0.01)


# --- end to end: hpc-train aggregate on a signed registry ----------------------------------


def run_aggregate(fleet: FleetRegistry, out: Path, *options: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="hpc-train")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([
        "aggregate", "--registry", str(fleet.root), "--model", fleet.name, "--base", "1",
        "--trusted-keys", str(fleet.trusted), "--out", str(out), *options])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = args.func(args)
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture
def fleet(tmp_path: Path) -> FleetRegistry:
    return FleetRegistry.create(tmp_path / "fleet")


def test_through_hpc_train_aggregate_one_device_moves_the_model_by_at_most_s_and_epsilon_is_z(
        fleet: FleetRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(11)
    base = {k: (0.05 * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}
    release = fleet.release("1", base)
    n = 6
    deltas, samples = device_updates(rng, n)
    ups = fleet.fine_tunes(release, base, deltas, samples=list(samples))
    versions = [u.version for u in ups]
    dp_flags = ["--clip-norm", f"{C:g}", "--dp-noise-multiplier", "1.1", "--dp-delta", "1e-5",
                "--dp-expected-weight", str(n), "--dp-weight-cap", "200"]
    dp = DpSettings(1.1, 1e-5, 1, C, expected_weight=n, weight_cap=200.0)

    noised = tmp_path / "noised"
    code, stdout, stderr = run_aggregate(fleet, noised, *dp_flags)
    assert code == 0, stderr
    report = json.loads((noised / "aggregate.json").read_text())["dp"]
    s_true = C / n  # the definition's bound: C x max weight (1) / W
    assert report["sensitivity"] == pytest.approx(s_true)
    assert report["noise_std"] == pytest.approx(1.1 * s_true)
    assert (report["noise_multiplier"], report["clip_norm"], report["sampling_rate"]) == (
        1.1, C, 1.0)
    # The epsilon reported is dp-accounting's for the noise over the TRUE sensitivity.
    assert report["epsilon_per_round"] == pytest.approx(
        rdp_epsilon(report["noise_std"] / s_true), rel=1e-6)
    assert report["epsilon"] == pytest.approx(4.24, abs=0.01)
    assert "sensitivity" in stdout and "sampling rate 1" in stdout

    # The pre-noise aggregate: the same run with the noise draw switched off.
    monkeypatch.setattr(GaussianNoise, "add", lambda self, combined: combined)
    runs = iter(range(100))

    def model(updates: list[str]) -> np.ndarray:
        out = tmp_path / f"pre-noise-{next(runs)}"
        code, _, stderr = run_aggregate(fleet, out, *dp_flags, "--updates", ",".join(updates))
        assert code == 0, stderr
        got = load_file(str(out / "model.safetensors"))
        return flat(got) - flat(base)

    full = model(versions)
    # What the round computed is the estimator from its definition (float32 sums).
    np.testing.assert_allclose(full, dp_aggregate(deltas, list(samples), dp), rtol=1e-5,
                               atol=1e-7)
    moves = {f"remove {v}": float(np.linalg.norm(full - model(versions[:k] + versions[k + 1:])))
             for k, v in enumerate(versions)}
    extra = fleet.update(fleet.device("worst"), release, {
        k: base[k] + v for k, v in worst_case(full).items()}, samples=HUGE)
    moves["add worst case"] = float(np.linalg.norm(model([*versions, extra.version]) - full))
    for case, move in moves.items():
        assert move <= s_true * (1 + 1e-5), (case, move, s_true)
    assert max(moves.values()) > 0.999 * s_true  # reached: the full-weight clipped device


def test_one_update_under_three_keys_is_flagged_and_honest_ones_are_not(
        fleet: FleetRegistry, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    base = {k: np.zeros(s, dtype=np.float32) for k, s in SHAPES.items()}
    release = fleet.release("1", base)
    honest = [{k: (0.01 * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}
              for _ in range(4)]
    fleet.fine_tunes(release, base, honest)
    out = tmp_path / "honest"
    code, stdout, stderr = run_aggregate(fleet, out, "--clip-norm", "1")
    assert code == 0, stderr
    report = json.loads((out / "aggregate.json").read_text())
    assert report["duplicates"]["groups"] == [] and "WARNING" not in stdout
    assert all(row["duplicate_group"] is None for row in report["updates"])

    # One update under three device keys (one device's, replayed by two more).
    one = {k: (0.01 * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}
    replayed = fleet.fine_tunes(release, base, [one] * 3, prefix="sybil")
    flags = ["--clip-norm", "1", "--dp-noise-multiplier", "1.1", "--dp-delta", "1e-5",
             "--dp-expected-weight", "7"]
    out = tmp_path / "sybil"
    code, stdout, stderr = run_aggregate(fleet, out, *flags)
    assert code == 0, stderr
    report = json.loads((out / "aggregate.json").read_text())
    (group,) = report["duplicates"]["groups"]
    assert sorted(group["versions"]) == sorted(u.version for u in replayed)
    assert len(group["keys"]) == 3 and group["min_cosine"] >= 0.9999
    assert group["norm_spread"] <= 1e-6
    assert "WARNING near-identical updates under 3 key(s)" in stdout
    rows = {r["version"]: r for r in report["updates"]}
    assert [rows[u.version]["duplicate_group"] for u in replayed] == [0, 0, 0]
    assert sum(r["duplicate_group"] is None for r in rows.values()) == 4
    assert len(report["combined"]) == 7  # kept and flagged: each key keeps its weight
    # Whoever stands behind the three keys counts three times: the guarantee of z / 3.
    sybil = report["dp"]["sybil_group"]
    assert sybil["keys"] == 3
    assert sybil["epsilon_per_round"] == pytest.approx(rdp_epsilon(1.1 / 3), rel=1e-6)
