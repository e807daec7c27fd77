"""``aggregate.json``: what a round combined, how, and what it left out and why.

Per update: the key that verified it, its release and staleness, sample count, its delta's L2
norm before and after clipping, the scale applied (clipping times the staleness discount),
its weight, and its distance to the combined delta (between the delta as combined - clipped
and discounted - and the combined delta before DP noise). Per skipped version: the reason.
Groups of near-identical updates (``duplicates``: a Sybil signal) and, under DP, the
mechanism's figures: z, the sensitivity S, C, the weights' cap and expected total, the
sampling rate and (epsilon, delta) per round and over the rounds.

The report is the aggregator's record, not a private release: it names the devices, their
norms and distances to the aggregate before the noise. Keep it where the operator keeps the
round; under DP do not publish it beside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpc_core.aggregation.combine import Blobs, Combined
from hpc_core.aggregation.duplicates import MIN_COSINE, NORM_RTOL, DuplicateGroup
from hpc_core.aggregation.options import Options
from hpc_core.aggregation.privacy import (
    ACCOUNTANT,
    ADJACENCY,
    ESTIMATOR,
    MAX_WEIGHT,
    SAMPLING_RATE,
    Privacy,
)
from hpc_core.aggregation.select import SAMPLES_METRIC, Selection, Skipped
from hpc_core.aggregation.strategies import STALENESS_EXPONENT
from registry.manifest import utc_now

FORMAT = "edgetrain.aggregate/1"


@dataclass(frozen=True)
class Scales:
    clip: list[float]
    staleness: list[float]
    clip_bound: float | None = None
    """The L2 bound every update was clipped to (``--clip-norm median``: that round's median
    norm); None: no clipping."""

    def total(self, i: int) -> float:
        return self.clip[i] * self.staleness[i]


@dataclass(frozen=True)
class Krum:
    scores: np.ndarray
    kept: np.ndarray
    """The indices combined, best first: Krum's pick alone, or M of them for Multi-Krum."""

    @property
    def chosen(self) -> int:
        """Krum's pick: the best score."""
        return int(self.kept[0])


def _round(x: float) -> float:
    return float(f"{x:.9g}")


def skipped_rows(selection: Selection, blobs: Blobs | None) -> list[dict[str, str]]:
    rows: list[Skipped] = list(selection.skipped) + (blobs.skipped if blobs else [])
    return [{"version": s.version, "reason": s.reason} for s in rows]


def _update_rows(blobs: Blobs, scales: Scales, weights: np.ndarray | None,
                 combined: Combined, krum: Krum | None,
                 duplicates: list[DuplicateGroup]) -> list[dict[str, Any]]:
    group_of = {i: g for g, group in enumerate(duplicates) for i in group.members}
    rows = []
    for i, m in enumerate(blobs.measured):
        u = m.update
        row: dict[str, Any] = {
            "version": u.version, "sequence": u.manifest.sequence,
            "key": f"{u.key.name} ({u.key.key_id})", "release": u.release.manifest.version,
            "staleness": u.release.staleness, "samples": u.samples,
            "norm": _round(m.norm), "clipped_norm": _round(m.norm * scales.clip[i]),
            "clip_scale": _round(scales.clip[i]),
            "staleness_scale": _round(scales.staleness[i]),
            "weight": None if weights is None else _round(float(weights[i])),
            "distance_to_aggregate": _round(float(combined.distances[i])),
            "duplicate_group": group_of.get(i),
        }
        if krum is not None:
            row["krum_score"] = _round(float(krum.scores[i]))
            row["chosen"] = bool(i in krum.kept)
        rows.append(row)
    return rows


def _duplicates(blobs: Blobs, groups: list[DuplicateGroup]) -> dict[str, Any]:
    return {
        "rule": f"delta norms within {NORM_RTOL:g} (relative) and cosine >= {MIN_COSINE:g}",
        "action": "kept and flagged: each key keeps its update's weight",
        "groups": [{
            "versions": [blobs.measured[i].update.version for i in g.members],
            "keys": sorted({f"{blobs.measured[i].update.key.name} "
                            f"({blobs.measured[i].update.key.key_id})" for i in g.members}),
            "min_cosine": _round(g.min_cosine), "norm_spread": _round(g.norm_spread),
        } for g in groups],
    }


def _privacy(privacy: Privacy, combined: Combined) -> dict[str, Any]:
    dp = privacy.settings
    return {
        "estimator": ESTIMATOR, "adjacency": ADJACENCY,
        "noise_multiplier": dp.noise_multiplier, "clip_norm": dp.clip_norm,
        "weight_cap": dp.weight_cap, "max_weight": MAX_WEIGHT,
        "expected_weight": dp.expected_weight, "weight_total": _round(privacy.weight_total),
        "sensitivity": _round(dp.sensitivity), "noise_std": _round(dp.noise_std),
        "noise_norm": _round(combined.noise_norm), "sampling_rate": SAMPLING_RATE,
        "delta": dp.delta, "epsilon_per_round": _round(privacy.epsilon_per_round),
        "epsilon": _round(privacy.epsilon), "rounds": dp.rounds,
        "epsilon_replace_one": _round(privacy.epsilon_replace_one),
        "sybil_group": None if privacy.group is None else {
            "keys": privacy.group.keys,
            "epsilon_per_round": _round(privacy.group.epsilon_per_round),
            "epsilon": _round(privacy.group.epsilon)},
        "accountant": ACCOUNTANT,
    }


def build(opts: Options, selection: Selection, blobs: Blobs, *, weighting: str | None,
          weights: np.ndarray | None, scales: Scales, combined: Combined, krum: Krum | None,
          privacy: Privacy | None, duplicates: list[DuplicateGroup]) -> dict[str, Any]:
    base = selection.base
    return {
        "format": FORMAT,
        "created_at": utc_now().isoformat().replace("+00:00", "Z"),
        "model": base.name,
        "base": {"version": base.version, "sequence": base.sequence},
        "strategy": opts.strategy,
        "params": opts.params(),
        "weighting": {
            "by": weighting,
            "samples_metric": SAMPLES_METRIC,
            "staleness": f"delta x 1 / (1 + staleness) ** {STALENESS_EXPONENT} (FedBuff)",
        },
        "lineage": [{"version": r.manifest.version, "sequence": r.manifest.sequence,
                     "staleness": r.staleness} for r in selection.lineage],
        "lineage_note": selection.lineage_note,
        "combined": [m.update.version for m in blobs.measured],
        "clip_bound": None if scales.clip_bound is None else _round(scales.clip_bound),
        "updates": _update_rows(blobs, scales, weights, combined, krum, duplicates),
        "duplicates": _duplicates(blobs, duplicates),
        "skipped": skipped_rows(selection, blobs),
        "ignored": selection.ignored,
        "krum": None if krum is None else {
            "f": opts.krum_f, "keep": opts.krum_keep,
            "chosen": blobs.measured[krum.chosen].update.version,
            "kept": [blobs.measured[int(i)].update.version for i in krum.kept]},
        "aggregate_delta_norm": _round(combined.delta_norm),
        "kept_from_base": combined.kept_from_base,
        "dp": None if privacy is None else _privacy(privacy, combined),
    }


def summary(report: dict[str, Any], out: str) -> str:
    """A few lines for the terminal; the whole story is in aggregate.json."""
    lines = [
        f"aggregated {len(report['combined'])} updates of {report['model']}@"
        f"{report['base']['version']} with {report['strategy']} into {out} "
        f"(combined delta norm {report['aggregate_delta_norm']:.4g})",
    ]
    for row in report["updates"]:
        weight = "" if row["weight"] is None else f", weight {row['weight']:.3g}"
        lines.append(
            f"  {row['version']}: norm {row['norm']:.4g} -> {row['clipped_norm']:.4g}, "
            f"staleness {row['staleness']}{weight}, distance {row['distance_to_aggregate']:.4g}"
            + (" (chosen)" if row.get("chosen") else ""))
    for row in report["skipped"]:
        lines.append(f"  skipped {row['version']}: {row['reason']}")
    for group in report["duplicates"]["groups"]:
        lines.append(f"  WARNING near-identical updates under {len(group['keys'])} key(s) "
                     f"(one update replayed?): {', '.join(group['versions'])}")
    if report["dp"]:
        dp = report["dp"]
        lines.append(
            f"  DP: z {dp['noise_multiplier']:g}, sensitivity S {dp['sensitivity']:.4g} (C "
            f"{dp['clip_norm']:g} / expected weight {dp['expected_weight']:g}; this round "
            f"{dp['weight_total']:.4g}), noise std z x S {dp['noise_std']:.4g}, sampling rate "
            f"{dp['sampling_rate']:g}; epsilon {dp['epsilon_per_round']:.4g} a round, "
            f"{dp['epsilon']:.4g} over {dp['rounds']} round(s), at delta {dp['delta']:g}")
        if dp["sybil_group"]:
            g = dp["sybil_group"]
            lines.append(f"  DP: a device behind the {g['keys']} keys of one update counts "
                         f"{g['keys']} times: epsilon {g['epsilon_per_round']:.4g} a round, "
                         f"{g['epsilon']:.4g} over {dp['rounds']}")
    return "\n".join(lines)


def too_few(opts: Options, need: int, usable: int, selection: Selection,
            blobs: Blobs | None) -> str:
    lines = [f"aggregate: {usable} usable update(s) of {opts.model}@{opts.base}, {need} needed "
             f"({opts.strategy}, --min-updates {opts.min_updates}); nothing written"]
    lines += [f"  skipped {r['version']}: {r['reason']}" for r in skipped_rows(selection, blobs)]
    if selection.ignored:
        lines.append("  not of this round: " + ", ".join(
            f"{n} ({why})" for why, n in sorted(selection.ignored.items())))
    if selection.lineage_note:
        lines.append(f"  lineage: {selection.lineage_note}")
    return "\n".join(lines)
