"""One spool record on disk: a *segment*, the samples of one ``Spool.record`` call.

``MAGIC | u32 header length | JSON header (space-padded to 16 bytes) | float32 samples``

The header (:class:`SegmentHeader`) holds each sample's label, pseudo flag and the model's
confidence, so the spool's index is rebuilt from headers alone, without reading samples.
A segment is written to a temporary file, fsynced and renamed (``registry.atomic``): a reader
sees it whole or not at all. Its name is ``BASE.GEN.seg``; compaction (rewriting a segment
without its evicted samples) writes ``BASE.GEN+1.seg`` before it deletes ``BASE.GEN.seg``,
so after a crash between the two the higher generation wins. :func:`check_record` turns a
record's arguments into the arrays a segment holds.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

MAGIC = b"EDGESPL1"
SUFFIX = ".seg"
NAME_RE = re.compile(r"^(\d{19}-\d{1,10}-\d{1,12})\.(\d{1,9})\.seg$")
MAX_HEADER_BYTES = 16 << 20
"""Bound on a header read back (a 1024-sample segment's is ~70 KB)."""
_PREFIX = struct.Struct("<8sI")


class SegmentError(ValueError):
    """A file in the spool that is not a whole segment."""


class SegmentHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: tuple[int, int, int, int]
    """N, C, H, W of the float32 samples that follow."""
    t: float
    """When the samples were recorded (Unix seconds): age retention and age ties."""
    y: list[int]
    """Each sample's label (a pseudo-label for a pseudo-labelled one)."""
    pseudo: list[bool]
    margin: list[float | None]
    """Softmax margin (``agent.spool.policy``); null when recorded without logits."""
    entropy: list[float | None]
    """Softmax entropy in nats; null when recorded without logits."""

    @model_validator(mode="after")
    def _lengths(self) -> SegmentHeader:
        n = self.shape[0]
        if min(self.shape) < 1:  # a record that stores nothing writes no segment
            raise ValueError(f"bad shape {list(self.shape)}")
        if not (len(self.y) == len(self.pseudo) == len(self.margin) == len(self.entropy) == n):
            raise ValueError(f"per-sample lists do not all have {n} entries")
        if any(v < 0 for v in self.y):
            raise ValueError("negative label")
        return self

    @property
    def data_bytes(self) -> int:
        return math.prod(self.shape) * 4


def encode(header: SegmentHeader, x: np.ndarray) -> bytes:
    """The segment's bytes (``x``: float32, C-contiguous, ``header.shape``)."""
    assert x.dtype == np.float32 and tuple(x.shape) == header.shape
    head = json.dumps(header.model_dump(mode="json"), separators=(",", ":"),
                      allow_nan=False).encode()
    # Padded so the samples start 16-byte aligned: np.frombuffer then needs no copy.
    head += b" " * (-(len(head) + _PREFIX.size) % 16)
    return _PREFIX.pack(MAGIC, len(head)) + head + np.ascontiguousarray(x).tobytes()


def header_bound(n: int, shape: tuple[int, int, int]) -> int:
    """An upper bound of an n-sample segment's size before its samples are known: the
    spool's quota check runs before the file exists."""
    per_sample = 2 * 25 + 21 + 7  # two floats (repr <= 24 chars + comma), a label, a flag
    return _PREFIX.size + 160 + n * per_sample + 16 + n * math.prod(shape) * 4


def read_header(path: str | Path) -> tuple[SegmentHeader, int, int]:
    """``(header, offset of the samples, file size)``; SegmentError for anything that is not a
    whole segment (a spool never publishes a partial one, so this is a foreign or damaged
    file). Plain os calls: opening a spool reads one header per segment."""
    name = os.path.basename(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, 4096, 0)
        if len(head) < _PREFIX.size:
            raise SegmentError(f"{name}: {len(head)} bytes, shorter than a header")
        magic, hlen = _PREFIX.unpack_from(head)
        if magic != MAGIC or hlen > MAX_HEADER_BYTES:
            raise SegmentError(f"{name}: not a spool segment")
        end = _PREFIX.size + hlen
        if end > len(head):
            head += os.pread(fd, end - len(head), len(head))
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    try:
        header = SegmentHeader.model_validate_json(head[_PREFIX.size:end])
    except ValidationError as e:
        raise SegmentError(f"{name}: bad header: {e.errors()[0]['msg']}") from None
    if size != end + header.data_bytes:
        raise SegmentError(f"{name}: {size} bytes, the header says {end + header.data_bytes}")
    return header, end, size


def read_samples(path: str | Path, shape: tuple[int, int, int, int], offset: int
                 ) -> np.ndarray:
    """A segment's samples as (N, C, H, W) float32."""
    nbytes = math.prod(shape) * 4
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    if len(data) != nbytes:
        raise SegmentError(f"{os.path.basename(path)}: truncated")
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def check_record(x: np.ndarray, label: int | np.ndarray | None, logits: np.ndarray | None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``Spool.record``'s arguments as the arrays a segment is made of: a float32 (N, C, H, W)
    batch, N labels (-1: none) and (N, K) float64 logits; ValueError when they do not fit
    together."""
    xb = np.asarray(x)
    if xb.ndim == 3:
        xb = xb[None]
    if xb.ndim != 4 or 0 in xb.shape[1:] or not np.issubdtype(xb.dtype, np.number):
        raise ValueError(f"x must be one sample (C, H, W) or a batch (N, C, H, W) of numbers, "
                         f"got shape {np.shape(x)} dtype {xb.dtype}")
    xb = np.ascontiguousarray(xb, dtype=np.float32)
    n = len(xb)
    labels = np.full(n, -1, np.int64)
    if label is not None:
        lab = np.asarray(label)
        if lab.ndim > 1 or (lab.ndim == 1 and len(lab) != n) or not np.issubdtype(
                lab.dtype, np.integer):
            raise ValueError(f"label must be an int or {n} ints, got {lab.dtype} {lab.shape}")
        if (lab < 0).any():
            raise ValueError("label must be >= 0 (leave it out for an unlabelled sample)")
        labels[:] = lab
    lg = None
    if logits is not None:
        lg = np.asarray(logits, dtype=np.float64)
        if lg.ndim == 1:
            lg = lg[None]
        if lg.ndim != 2 or len(lg) != n or lg.shape[1] < 2:
            raise ValueError(f"logits must be (K,) or (N, K) with K >= 2 for {n} samples, "
                             f"got {np.shape(logits)}")
        if (labels >= lg.shape[1]).any():
            raise ValueError(f"label {int(labels.max())} is outside the logits' "
                             f"{lg.shape[1]} classes")
    return xb, labels, lg
