"""One aggregation round end to end: select, verify and measure, combine, write, report."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from hpc_core.aggregation.blobs import ChunkCache
from hpc_core.aggregation.combine import (
    Blobs,
    Combined,
    combine,
    combined_tensors,
    measure_updates,
    numel,
    pairwise,
)
from hpc_core.aggregation.deltas import Deltas
from hpc_core.aggregation.duplicates import find_duplicates
from hpc_core.aggregation.options import MEDIAN_CLIP, Options
from hpc_core.aggregation.output import CheckpointWriter
from hpc_core.aggregation.privacy import (
    GaussianNoise,
    Privacy,
    account,
    clip_scale,
    dp_weights,
    is_statistic,
    one_per_key,
)
from hpc_core.aggregation.report import Krum, Scales, build, too_few
from hpc_core.aggregation.select import Selection, Skipped, lineage, load_base, select
from hpc_core.aggregation.strategies import (
    distances_to_mean,
    fedavg_weights,
    krum_kept,
    krum_scores,
    min_updates,
    staleness_scale,
)
from registry.credentials import credential_from_env
from registry.signing import load_trusted_keys
from registry.stores import LocalStore, open_store
from registry.transfer import TransferConfig


class TooFewUpdates(Exception):
    """Fewer usable updates than the round needs; the message lists every skip and why."""


def _scales(opts: Options, blobs: Blobs) -> Scales:
    bound = opts.clip_norm
    if bound == MEDIAN_CLIP:
        bound = float(np.median([m.norm for m in blobs.measured]))
    assert not isinstance(bound, str)
    clip = [clip_scale(m.norm, bound) for m in blobs.measured]
    stale = [staleness_scale(m.update.release.staleness) for m in blobs.measured]
    return Scales(clip, stale, bound)


def _select(opts: Options, store: Any, trusted: Any, cfg: TransferConfig) -> Selection:
    base = load_base(store, opts.model, opts.base, trusted, cfg)
    releases, note = lineage(store, base, opts.max_staleness, trusted, cfg)
    selection = select(store, base, releases, note, opts.updates, trusted, cfg)
    if opts.dp is not None:
        # The sensitivity is per device: a key with two updates in the round would move the
        # aggregate by 2 S. Its freshest one is combined.
        kept, dropped = one_per_key(selection.updates)
        selection.skipped += [Skipped(selection.updates[i].version, (
            f"another update signed by {selection.updates[i].key.name} is combined, "
            f"{other}: under DP a device adds one update a round")) for i, other in
            sorted(dropped.items())]
        selection.updates = [selection.updates[i] for i in kept]
    return selection


def run_round(opts: Options, rng: np.random.Generator | None = None) -> dict[str, Any]:
    """Aggregate into ``opts.out``; returns the report. Raises TooFewUpdates, RegistryError
    (UsageError: exit 2), ChunkChangedError; writes nothing unless it returns."""
    opts.check()
    trusted = load_trusted_keys(opts.trusted_keys)
    cfg = TransferConfig()
    store = open_store(opts.registry, cfg, credential_from_env())
    need = max(opts.min_updates, min_updates(opts.strategy, opts.trim, opts.krum_f,
                                                  opts.krum_keep))
    work: Path | None = None
    try:
        selection = _select(opts, store, trusted, cfg)
        if len(selection.updates) < need:
            raise TooFewUpdates(too_few(opts, need, len(selection.updates), selection, None))
        cache = None
        if not isinstance(store, LocalStore):
            work = Path(tempfile.mkdtemp(prefix=".aggregate-chunks-",
                                         dir=opts.work_dir or opts.out.parent))
            cache = ChunkCache(work)
        blobs = measure_updates(selection, store, cache, cfg,
                                keep_base=is_statistic if opts.dp is not None else None)
        if len(blobs.measured) < need:
            raise TooFewUpdates(too_few(opts, need, len(blobs.measured), selection, blobs))
        return _combine_and_write(opts, selection, blobs, rng)
    finally:
        store.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _combine_and_write(opts: Options, selection: Selection, blobs: Blobs,
                       rng: np.random.Generator | None) -> dict[str, Any]:
    scales = _scales(opts, blobs)
    for i, m in enumerate(blobs.measured):
        m.data.scale = scales.total(i)
    deltas = Deltas([m.data for m in blobs.measured])
    block_bytes = opts.block_bytes(sum(4 * numel(t) for t in combined_tensors(blobs.base)))
    duplicates = find_duplicates(blobs, block_bytes)
    weights, weighting = None, "none: coordinate-wise, every update alike"
    samples = [m.update.samples for m in blobs.measured]
    privacy: Privacy | None = None
    noise = None
    if opts.dp is not None:  # fedavg only (Options.check)
        weights, weighting = dp_weights(samples, opts.dp)
        privacy = account(opts.dp, weights, max((g.keys for g in duplicates), default=1))
        noise = GaussianNoise(opts.dp.noise_std, rng)
    elif opts.strategy == "fedavg":
        weights, weighting = fedavg_weights(samples)
    writer = CheckpointWriter(opts.out, selection.base)
    try:
        krum = None
        if opts.strategy == "krum":
            d2 = pairwise(deltas, blobs.base, block_bytes)
            scores = krum_scores(d2, opts.krum_f)
            kept = krum_kept(scores, opts.krum_keep)
            krum = Krum(scores, kept)
            # Multi-Krum averages what it keeps as fedavg would (Flower's to_keep does too).
            kept_w, by = fedavg_weights([blobs.measured[int(i)].update.samples for i in kept])
            weights = np.zeros(len(blobs.measured))
            weights[kept] = kept_w
            weighting = ("krum: the chosen update only" if len(kept) == 1 else
                         f"multi-krum: the {len(kept)} best-scored updates, weighted by {by}")
            result = combine(Deltas([blobs.measured[int(i)].data for i in kept]), blobs.base,
                             "fedavg", weights=kept_w, trim=0.0, block_bytes=block_bytes,
                             write=writer.write, measure_distances=False,
                             server_lr=opts.server_lr)
            result = replace(result, distances=distances_to_mean(d2, kept, kept_w))
        else:
            result = combine(deltas, blobs.base, opts.strategy,
                             weights=weights if weights is not None else np.empty(0),
                             trim=opts.trim, block_bytes=block_bytes, write=writer.write,
                             noise=noise, server_lr=opts.server_lr)
        report = build(opts, selection, blobs, weighting=weighting, weights=weights,
                       scales=scales, combined=result, krum=krum, privacy=privacy,
                       duplicates=duplicates)
        writer.finish(report, _metrics(result, blobs, privacy))
    except BaseException:
        writer.abort()
        raise
    return report


def _metrics(result: Combined, blobs: Blobs, privacy: Privacy | None) -> dict[str, float]:
    """What the published version's manifest carries about how it was made. Under DP not the
    combined delta's norm: it is taken before the noise, a release the noise does not cover."""
    out = {"aggregate/updates": float(len(blobs.measured))}
    if privacy is None:
        out["aggregate/delta_norm"] = result.delta_norm
    else:
        out["aggregate/dp_epsilon"] = privacy.epsilon
        out["aggregate/dp_noise_multiplier"] = privacy.noise_multiplier
    return out
