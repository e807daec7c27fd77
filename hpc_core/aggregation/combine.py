"""The passes of one aggregation round over the selected updates.

1. :func:`measure_updates`: per update, hash every chunk and sum its delta's squares in the
   same read (a piece at a time, two updates at a time from a folder registry, the kernel
   reading the next update meanwhile); an update whose chunks do not verify, or whose weights
   are not finite, is skipped here.
2. krum only, :func:`pairwise`: every pairwise distance, block by block across the N updates.
3. :func:`combine`: tensor by tensor, block by block: stack the N scaled deltas of the block
   (the next block is stacked in a second thread meanwhile, :func:`stacked`), combine them,
   accumulate each update's distance to the result, add DP noise, add the base and write the
   bytes out. The bytes come from the page cache by now (pass 1 read them), so this pass is
   compute: float32 and BLAS where float64 bought nothing (a distance is a float32 difference
   and a float32 dot per row, each block's sum kept in float64).

Memory: three N x block float32 arrays (the block, the next one, the block's differences to
the result) and a few block-sized float64 temporaries at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpc_core.aggregation.blobs import ChunkCache, ChunkChangedError, LocalBlob, local_blob
from hpc_core.aggregation.deltas import (
    Deltas,
    UpdateBlob,
    element_blocks,
    measure,
    read_elements,
    squared_norm,
    verify_release,
)
from hpc_core.aggregation.dtypes import COMBINED, encode, item_size
from hpc_core.aggregation.privacy import GaussianNoise, is_statistic
from hpc_core.aggregation.select import Release, Selection, Skipped, Update
from hpc_core.aggregation.strategies import (
    WORKER_THREADS,
    PairwiseDistances,
    Strategy,
    combine_block,
)
from registry.errors import RegistryError
from registry.manifest import TensorEntry
from registry.stores import LocalStore, RegistryStore
from registry.transfer import TransferConfig

COPY_PIECE = 1 << 20
"""Bytes of a kept (non-floating) base tensor copied at a time."""
MEASURE_THREADS = min(2, WORKER_THREADS)
"""Updates hashed and measured at a time: two keep a disk busy while the second core hashes
(sha256 runs at ~1.5 GB/s a core, about what a fast disk delivers); more would only contend
for the disk and its readahead."""


@dataclass
class Measured:
    update: Update
    data: UpdateBlob
    norm: float
    """L2 norm of the update's delta against its release, before clipping."""


@dataclass
class Blobs:
    base: LocalBlob
    measured: list[Measured] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def measure_updates(selection: Selection, store: RegistryStore, cache: ChunkCache | None,
                    cfg: TransferConfig, keep_base: Callable[[str], bool] | None = None) -> Blobs:
    """Pass 1. The base's chunks must verify (RegistryError otherwise); an update's that do
    not, or those of the older release it was trained from, skip that update. Tensors
    ``keep_base`` names keep the base's values (see :attr:`UpdateBlob.keep_base`)."""
    verified: dict[Path, tuple[int, int, int]] = {}
    releases: dict[str, LocalBlob | Exception] = {}

    def release_blob(release: Release) -> LocalBlob:
        version = release.manifest.version
        if version not in releases:
            try:
                blob = local_blob(store, release.manifest, cache, cfg, verified)
                verify_release(blob)
                releases[version] = blob
            except (RegistryError, OSError) as e:
                releases[version] = e
        found = releases[version]
        if isinstance(found, Exception):
            raise found
        return found

    out = Blobs(release_blob(selection.lineage[0]))
    updates = selection.updates
    # A folder registry's chunk files are read where they lie: while updates are hashed and
    # measured, the kernel reads the next one (remote chunks are fetched, and checked, first,
    # here in this thread). Hashing and measuring are compute that releases the GIL (sha256,
    # numpy, reads), so a folder registry's updates are measured MEASURE_THREADS at a time.
    ahead = isinstance(store, LocalStore)
    threads = MEASURE_THREADS if ahead else 1
    if ahead and updates:
        local_blob(store, updates[0].manifest, cache, cfg, verified).prefetch()
    results: list[Measured | Skipped | tuple[Update, UpdateBlob, Future[float]]] = []
    settled = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="aggregate-measure") as pool:
        try:
            for k, update in enumerate(updates):
                # At most ``threads`` updates in flight: the one prefetched is read next.
                settled = _settle(results, settled, k - threads)
                if ahead and k + 1 < len(updates):
                    local_blob(store, updates[k + 1].manifest, cache, cfg, verified).prefetch()
                try:
                    reference = release_blob(update.release)
                except (RegistryError, OSError) as e:
                    results.append(Skipped(update.version, f"its release "
                                           f"{update.release.manifest.ref} does not verify "
                                           f"({_why(e)})"))
                    continue
                try:
                    data = UpdateBlob(update.version, local_blob(
                        store, update.manifest, cache, cfg, verified), reference,
                        keep_base=keep_base)
                except (RegistryError, OSError) as e:
                    results.append(Skipped(update.version, _why(e)))
                    continue
                results.append((update, data, pool.submit(measure, data)))
            _settle(results, settled, len(results) - 1)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    for r in results:
        if isinstance(r, Measured):
            out.measured.append(r)
        elif isinstance(r, Skipped):
            out.skipped.append(r)
    return out


def _settle(results: list[Measured | Skipped | tuple[Update, UpdateBlob, Future[float]]],
            first: int, last: int) -> int:
    """Wait for the measurements of ``results[first:last + 1]``, put their outcome in place,
    and return the first index not settled."""
    for i in range(first, last + 1):
        r = results[i]
        if not isinstance(r, tuple):
            continue
        update, data, future = r
        try:
            norm = future.result()
        except ChunkChangedError:
            raise  # a release changed under us: the whole run is in doubt
        except (RegistryError, OSError) as e:
            results[i] = Skipped(update.version, _why(e))
            continue
        results[i] = (Measured(update, data, norm) if math.isfinite(norm)
                      else Skipped(update.version, "its weights hold NaN or infinity"))
    return max(first, last + 1)


def per_row(block_bytes: int, rows: int) -> int:
    """Elements per row of an N x block float32 block of about ``block_bytes``."""
    return max(1024, block_bytes // (4 * max(rows, 1)))


def combined_tensors(base: LocalBlob) -> list[TensorEntry]:
    return [t for t in sorted(base.manifest.tensors, key=lambda t: t.offset)
            if t.dtype in COMBINED]


def pairwise(deltas: Deltas, base: LocalBlob, block_bytes: int) -> np.ndarray:
    """Pass 2 (krum): N x N squared distances between the scaled deltas."""
    distances = PairwiseDistances(len(deltas.updates))
    step = per_row(block_bytes, len(deltas.updates))
    ranges = [(entry.name, start, stop) for entry in combined_tensors(base)
              for start, stop in element_blocks(numel(entry), step)]
    for block in stacked(deltas, ranges):
        distances.add(block)
    return distances.squared()


def stacked(deltas: Deltas, ranges: list[tuple[str, int, int]]) -> Iterator[np.ndarray]:
    """``deltas.stack`` of each (tensor, start, stop) in turn, the next one read in a second
    thread while the caller combines this one: reading N updates' ranges (page cache copies,
    a subtraction) is about half the pass, and preadv and numpy release the GIL. Two blocks
    are alive at a time."""
    if not ranges:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="aggregate-read") as reader:
        ahead = reader.submit(deltas.stack, *ranges[0])
        for nxt in ranges[1:]:
            block = ahead.result()
            ahead = reader.submit(deltas.stack, *nxt)
            yield block
        yield ahead.result()


@dataclass
class Combined:
    distances: np.ndarray
    """Each update's L2 distance to the combined delta (before DP noise)."""
    delta_norm: float
    """L2 norm of the combined delta (before DP noise)."""
    noise_norm: float
    kept_from_base: list[str]


def numel(entry: TensorEntry) -> int:
    """Elements of a tensor."""
    return entry.nbytes // item_size(entry.dtype)


def combine(deltas: Deltas, base: LocalBlob, strategy: Strategy, *, weights: np.ndarray,
            trim: float, block_bytes: int, write: Callable[[bytes], None],
            noise: GaussianNoise | None = None, measure_distances: bool = True,
            server_lr: float = 1.0) -> Combined:
    """Pass 3: write base + ``server_lr`` x combined delta for every tensor (running
    statistics: x 1), in the base's blob order. Distances and the delta's norm are the
    combined delta's, before the step and before DP noise; the step scales the noised delta
    (post-processing: the privacy accounting is unchanged)."""
    n = len(deltas.updates)
    dist2 = np.zeros(n, dtype=np.float64)
    delta2 = 0.0
    kept: list[str] = []
    step = per_row(block_bytes, n)
    diff = np.empty((0, 0), dtype=np.float32)
    entries = sorted(base.manifest.tensors, key=lambda t: t.offset)
    # A tensor no update changed keeps the base's bytes; not under DP, where every
    # coordinate is noised (which tensors the devices left alone is theirs to hide),
    # except the running statistics DP keeps at the base's values.
    combined_names = {e.name for e in entries if e.dtype in COMBINED and not (
        (noise is None or is_statistic(e.name))
        and all(u.unchanged(e.name) for u in deltas.updates))}
    blocks = stacked(deltas, [(e.name, start, stop) for e in entries if e.name in combined_names
                              for start, stop in element_blocks(numel(e), step)])
    try:
        for entry in entries:
            if entry.name not in combined_names:
                if entry.dtype not in COMBINED:
                    kept.append(entry.name)
                for start in range(0, entry.nbytes, COPY_PIECE):
                    raw = np.empty(min(COPY_PIECE, entry.nbytes - start), dtype=np.uint8)
                    base.read_into(raw, entry.offset + start)
                    write(raw.tobytes())
                continue
            # Running statistics (BatchNorm's mean and variance) are averages of what the devices
            # saw, not a direction to step along: a step past their mean can turn a variance
            # negative. They take the combined value as it is.
            lr = 1.0 if is_statistic(entry.name) else server_lr
            for start, stop in element_blocks(numel(entry), step):
                block = next(blocks)
                combined = combine_block(strategy, block, weights=weights, trim=trim)
                if measure_distances:
                    if diff.shape != block.shape:
                        diff = np.empty_like(block)
                    np.subtract(block, combined.astype(np.float32), out=diff)
                    with np.errstate(over="ignore"):  # squared_norm redoes an overflow in float64
                        for i in range(n):
                            dist2[i] += squared_norm(diff[i], block[i], combined)
                delta2 += float(np.dot(combined, combined))
                if noise is not None:
                    noise.add(combined)
                if lr != 1.0:
                    combined *= lr
                combined += read_elements(base, entry, start, stop)
                write(encode(combined, entry.dtype))
    finally:
        blocks.close()  # an early exit waits for the block being read
    noise_norm = math.sqrt(noise.sum_squares) if noise is not None else 0.0
    return Combined(np.sqrt(dist2), math.sqrt(delta2), noise_norm, kept)
