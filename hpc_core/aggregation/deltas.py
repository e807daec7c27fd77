"""Streaming readers of update deltas (update - the release it was trained from).

Nothing here holds a whole model: the first pass (:func:`measure`) walks one update's blob a
piece at a time while hashing its chunks, and sums the squares of its delta tensor by tensor;
later passes read the same element range ``[start, stop)`` of one tensor from every update
(:meth:`Deltas.stack`) into an N x block array, so memory is O(N x block) whatever the model
size. A tensor whose bytes equal the release's (the same sha256 in both signed manifests; a
head-only fine-tune leaves the body so) has a zero delta and is not read at all.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from hpc_core.aggregation.blobs import LocalBlob
from hpc_core.aggregation.dtypes import COMBINED, decode, item_size
from registry.manifest import TensorEntry

NATIVE_LITTLE = sys.byteorder == "little"
"""safetensors bytes are little-endian: read as native float32 as they lie (x86, Arm)."""


def read_elements(blob: LocalBlob, entry: TensorEntry, start: int, stop: int,
                  buffer: np.ndarray | None = None) -> np.ndarray:
    """Elements ``[start, stop)`` of a (flattened) tensor of ``blob`` as float32. A float32
    tensor's bytes are read straight into ``buffer`` (float32, ``stop - start``) when one is
    given, and it is returned: no temporary, a copy less; other dtypes decode into a new
    array."""
    size = item_size(entry.dtype)
    if buffer is not None and entry.dtype == "F32" and NATIVE_LITTLE:
        blob.read_into(buffer.view(np.uint8), entry.offset + start * size)
        return buffer
    raw = np.empty((stop - start) * size, dtype=np.uint8)
    blob.read_into(raw, entry.offset + start * size)
    return decode(raw, entry.dtype)


def tensor_pieces(
    tensors: Iterable[TensorEntry], pieces: Iterable[tuple[int, memoryview]]
) -> Iterator[tuple[TensorEntry, int, np.ndarray]]:
    """Cut a blob streamed as (offset, bytes) pieces into (tensor, first element, whole
    elements as uint8) pieces; bytes of an element split across two pieces are carried over.
    Artefact bytes are passed over. A yielded array is valid until the next one."""
    entries = sorted(tensors, key=lambda t: t.offset)
    starts = [t.offset for t in entries]
    carry: dict[str, bytes] = {}
    for offset, data in pieces:
        end = offset + len(data)
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        while i < len(entries) and entries[i].offset < end:
            entry = entries[i]
            i += 1
            lo, hi = max(offset, entry.offset), min(end, entry.offset + entry.nbytes)
            if lo >= hi:
                continue
            size = item_size(entry.dtype)
            pending = carry.pop(entry.name, b"")
            buf: bytes | memoryview = data[lo - offset : hi - offset]
            if pending:
                buf = pending + bytes(buf)
            first = lo - entry.offset - len(pending)  # element-aligned by construction
            whole = len(buf) // size * size
            if whole:
                yield entry, first // size, np.frombuffer(buf[:whole], dtype=np.uint8)
            if whole < len(buf):
                carry[entry.name] = bytes(buf[whole:])


@dataclass
class UpdateBlob:
    """One update's bytes and those of the release it was trained from."""

    version: str
    blob: LocalBlob
    reference: LocalBlob
    scale: float = 1.0
    """Applied to the delta when it is combined: clipping times the staleness discount."""
    keep_base: Callable[[str], bool] | None = None
    """Tensors whose base values stand whatever the update holds (DP: running statistics);
    they count as unchanged, so they are neither measured nor combined."""

    def __post_init__(self) -> None:
        self.entries = {t.name: t for t in self.blob.manifest.tensors}
        self.ref_entries = {t.name: t for t in self.reference.manifest.tensors}

    def unchanged(self, name: str) -> bool:
        if self.keep_base is not None and self.keep_base(name):
            return True
        return self.entries[name].sha256 == self.ref_entries[name].sha256


def measure(update: UpdateBlob) -> float:
    """Verify every chunk of the update (ChunkHashError, TruncatedError) and return the L2
    norm of its delta over the combined (floating-point) tensors; non-finite for NaN/Inf."""
    changed = sorted((t.offset, t.offset + t.nbytes) for t in update.blob.manifest.tensors
                     if t.dtype in COMBINED and not update.unchanged(t.name))
    starts = [lo for lo, _ in changed]

    def wanted(start: int, end: int) -> bool:  # does [start, end) hold a changed tensor?
        i = bisect.bisect_left(starts, end) - 1
        return i >= 0 and changed[i][1] > start

    pieces = tensor_pieces(update.blob.manifest.tensors, update.blob.verify(wanted))
    with np.errstate(over="ignore"):  # squared_norm sees a float32 overflow and redoes it
        return _measure(update, pieces)


def _measure(update: UpdateBlob, pieces: Iterator[tuple[TensorEntry, int, np.ndarray]]) -> float:
    total = 0.0
    for entry, first, raw in pieces:
        if entry.dtype not in COMBINED or update.unchanged(entry.name):
            continue
        values = decode(raw, entry.dtype)
        ref = read_elements(update.reference, update.ref_entries[entry.name], first,
                            first + len(values))
        total += squared_norm(np.subtract(values, ref), values, ref)
    return float(np.sqrt(total))


def squared_norm(delta: np.ndarray, values: np.ndarray, ref: np.ndarray) -> float:
    """``delta . delta`` for the float32 ``delta = values - ref``: BLAS's float32 dot (its
    relative error ~1e-7 here, 10x faster than going through float64); where that overflows
    float32 (an update scaled to ~1e19 or more) or the inputs are not finite, float64 says
    which of the two it was: a huge norm is clipped or reported, a NaN is skipped. Callers
    run it under ``np.errstate(over="ignore")``, once per update or block (a context per call
    would cost more than the dot)."""
    sq = float(np.dot(delta, delta))
    if not math.isfinite(sq):
        exact = np.subtract(values, ref, dtype=np.float64)
        sq = float(np.dot(exact, exact))
    return sq


def verify_release(blob: LocalBlob) -> None:
    """Hash every chunk of a release (the base, a stale update's release)."""
    for _ in blob.verify():
        pass


class Deltas:
    """The N updates' scaled deltas, read one element range of one tensor at a time."""

    def __init__(self, updates: list[UpdateBlob]) -> None:
        self.updates = updates

    def stack(self, name: str, start: int, stop: int) -> np.ndarray:
        """An N x (stop - start) float32 array: row i is update i's scaled delta."""
        out = np.zeros((len(self.updates), stop - start), dtype=np.float32)
        refs: dict[int, np.ndarray] = {}  # one read of each release's range per block
        for i, u in enumerate(self.updates):
            if u.unchanged(name) or u.scale == 0.0:
                continue
            key = id(u.reference)
            if key not in refs:
                refs[key] = read_elements(u.reference, u.ref_entries[name], start, stop)
            row = out[i]
            np.subtract(read_elements(u.blob, u.entries[name], start, stop, buffer=row),
                        refs[key], out=row)
            if u.scale != 1.0:
                row *= np.float32(u.scale)
        return out


def element_blocks(numel: int, per_row: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of at most ``per_row`` elements covering a flattened tensor."""
    for start in range(0, numel, per_row):
        yield start, min(numel, start + per_row)
