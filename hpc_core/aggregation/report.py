"""``aggregate.json``: what a round combined, how, and what it left out and why.

Per update: the key that verified it, its release and staleness, sample count, its delta's L2
norm before and after clipping, the scale applied (clipping times the staleness discount),
its weight, and its distance to the combined delta (between the delta as combined - clipped
and discounted - and the combined delta before DP noise). Per skipped version: the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpc_core.aggregation.combine import Blobs, Combined
from hpc_core.aggregation.options import Options
from hpc_core.aggregation.privacy import ACCOUNTANT, Privacy
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
                 combined: Combined, krum: Krum | None) -> list[dict[str, Any]]:
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
        }
        if krum is not None:
            row["krum_score"] = _round(float(krum.scores[i]))
            row["chosen"] = bool(i in krum.kept)
        rows.append(row)
    return rows


def build(opts: Options, selection: Selection, blobs: Blobs, *, weighting: str | None,
          weights: np.ndarray | None, scales: Scales, combined: Combined, krum: Krum | None,
          privacy: Privacy | None) -> dict[str, Any]:
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
        "updates": _update_rows(blobs, scales, weights, combined, krum),
        "skipped": skipped_rows(selection, blobs),
        "ignored": selection.ignored,
        "krum": None if krum is None else {
            "f": opts.krum_f, "keep": opts.krum_keep,
            "chosen": blobs.measured[krum.chosen].update.version,
            "kept": [blobs.measured[int(i)].update.version for i in krum.kept]},
        "aggregate_delta_norm": _round(combined.delta_norm),
        "kept_from_base": combined.kept_from_base,
        "dp": None if privacy is None else {
            "noise_multiplier": privacy.noise_multiplier, "clip_norm": opts.clip_norm,
            "noise_std": _round(privacy.noise_std), "noise_norm": _round(combined.noise_norm),
            "delta": privacy.delta, "epsilon": _round(privacy.epsilon),
            "rounds": privacy.rounds, "accountant": ACCOUNTANT,
        },
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
    if report["dp"]:
        dp = report["dp"]
        lines.append(f"  DP: noise std {dp['noise_std']:.4g}; (epsilon, delta) = "
                     f"({dp['epsilon']:.4g}, {dp['delta']:g}) over {dp['rounds']} round(s)")
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
