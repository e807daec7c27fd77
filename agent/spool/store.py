"""The spool: samples recorded on the device, kept within a disk quota, snapshot for a
fine-tune.

Layout of a spool folder (``DATA_ROOT/spool/MODEL``)::

    spool.json          format and config (agent.spool.config.SpoolMarker)
    spool.lock          flock target; its first 8 bytes count the spool's changes
    dead.json           samples evicted out of segments that still hold kept ones
    BASE.GEN.seg        one segment per record call (agent.spool.segment)

Crash safety: a segment is written to a temporary file, fsynced and renamed, so a kill -9 at
any point leaves every segment whole or absent, and a record that returned is on disk. The
index (``agent.spool.index``) lives in memory and is rebuilt from the segment headers and
``dead.json`` on open; ``dead.json`` keeps an evicted sample evicted: were it lost, the
sample would be back and evicted again by the same policy. Every change happens under an
exclusive ``flock`` on ``spool.lock`` (and a thread lock), and bumps the counter in it
first, so a process whose index is older (another process recorded, or died half-way
through a change) rescans before it acts.

Quota: segment files are counted rounded up to the filesystem block. Kept samples may use
90% of ``quota_mb``; evicting a sample out of a multi-sample segment only marks it (a
rewrite per eviction would cost a write and an fsync per evicted sample), and once the
marked bytes pass the other 10% the most-marked segments are rewritten without them. So
between calls the bytes on disk stay within the quota; inside one call a rewrite adds at
most one segment, and ``min_free_disk_mb`` keeps that headroom on the filesystem.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from agent.spool.config import MARKER, MB, SpoolConfig, SpoolMarker
from agent.spool.index import Index
from agent.spool.policy import confidence, eviction_order, evictions, scores, softmax
from agent.spool.segment import SUFFIX, SegmentHeader, check_record, encode, header_bound
from agent.spool.snapshot import SnapshotInfo, class_counts, write_snapshot
from registry.atomic import remove_stale_temps, write_bytes_atomic

log = logging.getLogger("agent.spool")

LOCK = "spool.lock"
COMPACT_RESERVE = 0.1
"""Share of the quota for samples evicted out of segments that still hold kept ones."""
MAX_SEGMENT = 1024
"""Samples per segment file: a bigger batch is written as several."""
WARN_EVERY_S = 60.0
"""At most one log line per drop reason this often: an application recording hundreds of
samples a second into a full disk must not flood the journal."""
_names = itertools.count()
Reason = Literal["unlabelled", "not_finite", "quota", "class_cap", "disk_full", "shape",
                 "error"]


class SpoolStats(BaseModel):
    model_config = ConfigDict(extra="forbid")

    samples: int
    """Samples kept (all labelled or pseudo-labelled)."""
    pseudo_labelled: int
    per_class: dict[int, int]
    sample_shape: tuple[int, int, int] | None
    """C, H, W of the kept samples (null: none kept)."""
    segments: int
    bytes_on_disk: int
    """Segment files, each rounded up to the filesystem block."""
    evicted_bytes: int
    """Of bytes_on_disk: what rewriting the segments without their evicted samples frees."""
    quota_bytes: int
    recording: bool
    """False while min_free_disk_mb stops recording."""
    recorded: int
    """Samples this process stored since it opened the spool."""
    dropped: dict[str, int]
    """Samples this process was given but did not store, by reason."""
    evicted: dict[str, int]
    """Stored samples this process evicted, by reason (quota, class_cap, age)."""
    compacted: int
    """Segments this process rewrote without their evicted samples."""


@dataclass
class _New:
    x: np.ndarray
    y: np.ndarray
    pseudo: np.ndarray
    margin: np.ndarray
    entropy: np.ndarray
    t: float


class Spool:
    """A model's spool at ``root`` (created if missing), kept by ``config``.

    ``record`` is for an application's request path: it never raises for a full disk, the
    quota, a class cap or an I/O error; it stores what the policy keeps, evicts what it must,
    and counts the rest (``stats``). Thread-safe, and several processes may record into one
    spool at once."""

    def __init__(self, root: Path, config: SpoolConfig) -> None:
        self.root, self.config = Path(root), config
        self.root.mkdir(parents=True, exist_ok=True)
        self._mu = threading.Lock()
        self._fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        self._known = -1
        self._index = Index(self.root)
        self._recorded = self._compacted = 0
        self._dropped: dict[str, int] = {}
        self._evicted: dict[str, int] = {}
        self._recording = True
        self._warned: dict[str, float] = {}
        marker = SpoolMarker(config=config)
        with self._locked(change=True):
            path = self.root / MARKER
            if not path.is_file() or _read_marker(path) != marker:
                write_bytes_atomic(path, marker.model_dump_json(indent=1).encode())
            remove_stale_temps(self.root)
            self._expire(time.time())
            self._enforce(None)
            self._compact_if_needed()

    @classmethod
    def open(cls, root: Path) -> Spool:
        """The spool at ``root`` with the config it was last opened with (``spool.json``):
        for a reader that has no config of its own, such as the fine-tune step."""
        path = Path(root) / MARKER
        marker = _read_marker(path) if path.is_file() else None
        if marker is None:
            raise ValueError(f"{root} is not a spool (no valid {MARKER})")
        return cls(root, marker.config)

    def close(self) -> None:
        with self._mu:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the application's side ------------------------------------------------------------

    def record(self, x: np.ndarray, *, label: int | np.ndarray | None = None,
               logits: np.ndarray | None = None) -> int:
        """Store one sample (C, H, W) or a batch (N, C, H, W), with its label (one for all, or
        one per sample) and the model's logits ((K,) or (N, K)) when there are any; returns
        how many were stored. ValueError only for arguments that do not fit together."""
        xb, labels, lg = check_record(x, label, logits)
        try:
            with self._locked(change=True):
                return self._record(xb, labels, lg)
        except OSError as e:
            self._drop("error", len(xb), f"recording failed: {e}")
            return 0

    def stats(self) -> SpoolStats:
        with self._locked(change=False):
            ix = self._index
            live = ix.rows.live[: ix.rows.n]
            return SpoolStats(
                samples=int(live.sum()),
                pseudo_labelled=int(ix.rows.pseudo[: ix.rows.n][live].sum()),
                per_class=class_counts(ix.rows.y[: ix.rows.n][live]), sample_shape=ix.shape,
                segments=len(ix.segs), bytes_on_disk=ix.disk, evicted_bytes=ix.disk - ix.kept,
                quota_bytes=self._quota, recording=self._recording, recorded=self._recorded,
                dropped=dict(self._dropped), evicted=dict(self._evicted),
                compacted=self._compacted)

    def snapshot(self, out: Path) -> SnapshotInfo:
        """Write the kept samples to the .npz ``out`` (atomically) and describe it. Samples
        are read under the lock and written after it, so recording waits only for the
        reads."""
        with self._locked(change=True):
            self._expire(time.time())
            x, y, pseudo = self._index.gather()
        return write_snapshot(Path(out), x, y, pseudo)

    # -- locking ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, *, change: bool) -> Iterator[None]:
        with self._mu:
            if self._fd < 0:
                raise OSError(f"spool {self.root} is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                count = int.from_bytes(os.pread(self._fd, 8, 0).ljust(8, b"\0"), "little")
                if count != self._known:
                    self._index.rescan()
                if change:
                    # Bumped before the change: were this process killed half-way, the
                    # others still see a count they do not know and rescan.
                    count += 1
                    os.pwrite(self._fd, count.to_bytes(8, "little"), 0)
                self._known = count
                yield
                self._index.compact_rows()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- recording and eviction ------------------------------------------------------------

    @property
    def _quota(self) -> int:
        return int(self.config.quota_mb * MB)

    def _record(self, x: np.ndarray, labels: np.ndarray, logits: np.ndarray | None) -> int:
        now = time.time()
        self._expire(now)
        new = self._score(x, labels, logits, now)
        if new is None:
            return 0
        shape = self._index.shape
        if shape is not None and tuple(x.shape[1:]) != shape:
            self._drop("shape", len(new.y), f"samples of shape {tuple(x.shape[1:])} do not "
                       f"match the spool's {shape}: dropped until the kept ones age out")
            return 0
        need = self._index.round(header_bound(len(new.y), x.shape[1:]))
        free = shutil.disk_usage(self.root).free
        if free - need < self.config.min_free_disk_mb * MB:
            self._recording = False
            self._drop("disk_full", len(new.y), f"{free / MB:.0f} MB free on the spool's "
                       f"filesystem, min_free_disk_mb={self.config.min_free_disk_mb:g}: "
                       "recording stops until space is freed")
            return 0
        self._recording = True
        keep = np.flatnonzero(self._enforce(new))
        stored = 0
        for lo in range(0, len(keep), MAX_SEGMENT):
            sel = keep[lo: lo + MAX_SEGMENT]
            try:
                self._write(new, sel)
            except OSError as e:
                self._drop("error", len(sel), f"writing a record failed: {e}")
                continue
            stored += len(sel)
        self._recorded += stored
        self._compact_if_needed()
        return stored

    def _score(self, x: np.ndarray, labels: np.ndarray, logits: np.ndarray | None,
               now: float) -> _New | None:
        """The samples worth keeping: labelled ones, and unlabelled ones the model was sure
        enough of to pseudo-label (the rest are dropped and counted)."""
        n = len(x)
        margin = entropy = np.full(n, np.nan)
        pseudo = np.zeros(n, bool)
        y = labels.copy()
        if logits is not None:
            ok = np.isfinite(logits).all(axis=1)  # a NaN output scores nothing
            probs = softmax(np.where(ok[:, None], logits, 0.0))
            margin, entropy = scores(probs, labels)
            margin[~ok], entropy[~ok] = np.nan, np.nan
            thr = self.config.pseudo_label_threshold
            if thr is not None:
                pseudo = (labels < 0) & ok & (probs.max(axis=1) >= thr)
                y[pseudo] = probs.argmax(axis=1)[pseudo]
        keep = y >= 0
        if not keep.all():
            self._drop("unlabelled", int((~keep).sum()))
        finite = np.isfinite(x).reshape(n, -1).all(axis=1)  # a NaN image would poison training
        if not finite.all():
            self._drop("not_finite", int((keep & ~finite).sum()))
            keep &= finite
        if not keep.any():
            return None
        return _New(x=x[keep], y=y[keep], pseudo=pseudo[keep], margin=margin[keep],
                    entropy=entropy[keep], t=now)

    def _enforce(self, new: _New | None) -> np.ndarray:
        """Evict what the class cap and the quota say must go, the new samples candidates
        like the kept ones; returns which new samples to store."""
        ix, rows, rule = self._index, self._index.rows, self.config.hard_example
        idx = np.flatnonzero(rows.live[: rows.n])
        old = len(idx)
        conf = confidence(rule, rows.margin[idx], rows.entropy[idx])
        t, y = rows.t[idx], rows.y[idx]
        if new is not None:
            conf = np.concatenate([conf, confidence(rule, new.margin, new.entropy)])
            t = np.concatenate([t, np.full(len(new.y), new.t)])
            y = np.concatenate([y, new.y])
        tie = np.arange(len(conf))
        out = np.zeros(len(conf), bool)
        reason: dict[int, str] = {}
        cap = self.config.per_class_cap
        if cap is not None:  # on open every class, on a record the record's classes
            for c in np.unique(y if new is None else new.y):
                members = np.flatnonzero(y == c)
                order = members[eviction_order(conf[members], t[members], tie[members])]
                excess = order[: max(0, len(members) - cap)]
                out[excess] = True
                reason.update(dict.fromkeys(excess.tolist(), "class_cap"))
        left: dict[int, int] = {}
        seg_of = rows.seg[idx]

        def freed(i: int) -> int:
            # A sample smaller than a block frees bytes only when its segment's block count
            # drops: evicting it alone may free nothing, and eviction goes on to the next.
            no = int(seg_of[i])
            seg = ix.segs[no]
            k = left[no] = left.get(no, seg.live) - 1
            return seg.cost(k + 1) - seg.cost(k)

        kept_bytes = ix.kept - sum(freed(int(i)) for i in np.flatnonzero(out[:old]))
        kept_new = len(conf) - old - int(out[old:].sum())
        shape = new.x.shape[1:] if new is not None else ix.shape or (1, 1, 1)

        def new_bytes(k: int) -> int:
            whole, rest = divmod(k, MAX_SEGMENT)
            return whole * ix.round(header_bound(MAX_SEGMENT, shape)) + (
                ix.round(header_bound(rest, shape)) if rest else 0)

        limit = self._quota * (1 - COMPACT_RESERVE)
        over = kept_bytes + new_bytes(kept_new) - limit
        if over > 0:
            guess = kept_new + int(over // (4 * math.prod(shape))) + 8
            for i in evictions(conf, t, tie, guess):
                if kept_bytes + new_bytes(kept_new) <= limit:
                    break
                if not out[i]:
                    out[i], reason[int(i)] = True, "quota"
                    if i >= old:
                        kept_new -= 1
                    else:
                        kept_bytes -= freed(int(i))
        victims: dict[str, dict[int, list[int]]] = {}
        for i in np.flatnonzero(out):
            if i >= old:
                self._drop(reason[int(i)], 1)  # type: ignore[arg-type]
            else:
                victims.setdefault(reason[int(i)], {}).setdefault(
                    int(seg_of[i]), []).append(int(idx[i]))
        for why, by_seg in victims.items():
            self._evict(by_seg, why)
        return ~out[old:]

    def _evict(self, by_seg: dict[int, list[int]], why: str) -> None:
        """Evict rows: a segment left with none is deleted, others get marks in dead.json."""
        marked = False
        for no, rows in by_seg.items():
            seg = self._index.segs.get(no)
            if seg is None:
                continue
            self._evicted[why] = self._evicted.get(why, 0) + len(rows)
            if len(rows) >= seg.live:
                self._index.remove(seg)
            else:
                self._index.mark(seg, rows)
                marked = True
        if marked:
            self._save_dead()

    def _expire(self, now: float) -> None:
        ix = self._index
        if self.config.max_age_s is None or not ix.segs:
            return
        cutoff = now - self.config.max_age_s
        if ix.rows.t[: ix.rows.n][ix.rows.seg[: ix.rows.n] >= 0].min() >= cutoff:
            return  # one vector pass per record; the loop below only when something is old
        for seg in [s for s in ix.segs.values() if s.t < cutoff]:
            self._evicted["age"] = self._evicted.get("age", 0) + seg.live
            ix.remove(seg)

    def _write(self, new: _New, sel: np.ndarray) -> None:
        h = SegmentHeader(
            shape=(len(sel), *new.x.shape[1:]), t=new.t, y=new.y[sel].tolist(),
            pseudo=new.pseudo[sel].tolist(), margin=_nullable(new.margin[sel]),
            entropy=_nullable(new.entropy[sel]))
        name = f"{time.time_ns():019d}-{os.getpid()}-{next(_names)}.0{SUFFIX}"
        data = encode(h, np.ascontiguousarray(new.x[sel]))
        write_bytes_atomic(self.root / name, data)
        self._index.add([(name, 0, h, len(data) - h.data_bytes, len(data))])

    def _compact_if_needed(self) -> None:
        """Rewrite the segments with the most evicted bytes without them, until the evicted
        bytes are back within their reserve: a few rewrites per record, never a burst."""
        ix, reserve = self._index, self._quota * COMPACT_RESERVE
        if ix.disk - ix.kept <= reserve:
            return
        for seg in sorted(ix.segs.values(), key=lambda s: s.cost() - s.disk):
            if ix.disk - ix.kept <= reserve or seg.cost() == seg.disk:
                break
            try:
                ix.rewrite(seg)
            except OSError as e:
                self._warn("error", f"compacting {seg.name} failed: {e}")
                break
            self._compacted += 1
        self._save_dead()

    def _save_dead(self) -> None:
        try:
            self._index.save_dead()
        except OSError as e:  # the marks stay in memory; lost, the policy evicts again
            self._warn("error", f"writing dead.json failed: {e}")

    # -- counting what was not stored ------------------------------------------------------

    def _drop(self, reason: Reason, n: int, why: str | None = None) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + n
        if why is not None:
            self._warn(reason, why)

    def _warn(self, reason: str, why: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(reason, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[reason] = now
            log.warning("spool %s: %s", self.root, why)


def _nullable(a: np.ndarray) -> list[float | None]:
    return [None if np.isnan(v) else float(v) for v in a]


def _read_marker(path: Path) -> SpoolMarker | None:
    try:
        return SpoolMarker.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
