"""The spool's index: which samples are on disk, with their labels, confidences and ages, as
arrays the eviction policy can sort. Rebuilt from the segment headers and ``dead.json``
(:meth:`Index.rescan`); never persisted itself, so there is nothing to go stale after a crash.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from agent.spool.segment import (
    NAME_RE,
    SUFFIX,
    SegmentError,
    SegmentHeader,
    encode,
    read_header,
    read_samples,
)
from registry.atomic import write_bytes_atomic

log = logging.getLogger("agent.spool")

DEAD = "dead.json"
_COLUMNS = ("seg", "y", "pseudo", "margin", "entropy", "t", "live")


class _Dead(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["edgetrain.spool.dead/1"] = "edgetrain.spool.dead/1"
    dead: dict[str, list[int]]
    """Segment file name -> indices of its evicted samples."""


@dataclass
class Segment:
    name: str
    base: str
    gen: int
    start: int
    """Its first row in the index's table."""
    n: int
    live: int
    t: float
    shape: tuple[int, int, int]
    offset: int
    """Where its samples start: the header's bytes."""
    disk: int
    block: int

    def cost(self, live: int | None = None) -> int:
        """What the segment takes once rewritten with ``live`` (its kept) samples: a header
        with fewer entries is no longer, so a compaction never takes more than this."""
        live = self.live if live is None else live
        size = self.offset + live * math.prod(self.shape) * 4
        return -(-size // self.block) * self.block if live else 0


class Rows:
    """One row per sample on disk, a segment's rows contiguous; ``seg`` -1: a removed
    segment's row, reclaimed by :meth:`compact`."""

    def __init__(self) -> None:
        self.n = self.removed = 0
        self.seg = np.zeros(0, np.int64)
        self.y = np.zeros(0, np.int64)
        self.pseudo = np.zeros(0, bool)
        self.margin = np.zeros(0, np.float64)
        self.entropy = np.zeros(0, np.float64)
        self.t = np.zeros(0, np.float64)
        self.live = np.zeros(0, bool)

    def add(self, segs: list[tuple[int, SegmentHeader]]) -> list[int]:
        """Rows for ``(segment number, header)`` pairs, in one pass (opening a spool adds
        thousands); returns each segment's first row."""
        counts = [h.shape[0] for _, h in segs]
        start, n = self.n, sum(counts)
        if start + n > len(self.seg):
            cap = max(1024, 2 * (start + n))
            for k in _COLUMNS:
                a = getattr(self, k)
                grown = np.zeros(cap, a.dtype)
                grown[:start] = a[:start]
                setattr(self, k, grown)
        s = slice(start, start + n)
        self.seg[s] = np.repeat([no for no, _ in segs], counts)
        self.t[s] = np.repeat([h.t for _, h in segs], counts)
        self.y[s] = [v for _, h in segs for v in h.y]
        self.pseudo[s] = [v for _, h in segs for v in h.pseudo]
        self.margin[s] = [np.nan if v is None else v for _, h in segs for v in h.margin]
        self.entropy[s] = [np.nan if v is None else v for _, h in segs for v in h.entropy]
        self.live[s] = True
        self.n += n
        return (start + np.cumsum([0, *counts[:-1]])).tolist()  # type: ignore[no-any-return]

    def drop(self, seg: Segment) -> None:
        s = slice(seg.start, seg.start + seg.n)
        self.seg[s], self.live[s] = -1, False
        self.removed += seg.n

    def compact(self, segs: dict[int, Segment]) -> None:
        keep = self.seg[: self.n] >= 0
        new_index = np.cumsum(keep) - 1
        for s in segs.values():
            s.start = int(new_index[s.start])
        for k in _COLUMNS:
            setattr(self, k, getattr(self, k)[: self.n][keep].copy())
        self.n, self.removed = int(keep.sum()), 0


class Index:
    """The segments of the spool at ``root`` and their rows. ``disk`` is what the segment
    files take (each rounded up to the block), ``kept`` what they would take rewritten
    without their evicted samples (:meth:`Segment.cost`): the difference is what
    compaction reclaims."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.block = max(512, os.statvfs(root).f_bsize)
        self.segs: dict[int, Segment] = {}
        self.by_name: dict[str, int] = {}
        self.dead: dict[str, list[int]] = {}
        self.rows = Rows()
        self.disk = self.kept = 0
        self._newest: str | None = None
        self._numbers = itertools.count()

    def round(self, size: int) -> int:
        return -(-size // self.block) * self.block

    @property
    def shape(self) -> tuple[int, int, int] | None:
        """The kept samples' C, H, W: the newest segment's (names sort by recording time)."""
        return None if self._newest is None else self.segs[self.by_name[self._newest]].shape

    def rescan(self) -> None:
        """Bring the index in line with the files: new segments read (headers only), vanished
        ones forgotten, superseded generations deleted, ``dead.json`` applied."""
        present: dict[str, int] = {}
        for gens in generations(self.root).values():
            for _, name in gens[:-1]:  # a compaction cut short: its newer file is whole
                unlink(self.root / name)
            present[gens[-1][1]] = gens[-1][0]
        for name in [n for n in self.by_name if n not in present]:
            self.forget(self.segs[self.by_name[name]])
        new = []
        for name in sorted(set(present) - set(self.by_name)):
            try:
                new.append((name, present[name], *read_header(os.path.join(self.root, name))))
            except FileNotFoundError:
                continue
            except SegmentError as e:
                log.warning("spool %s: deleting %s", self.root, e)
                unlink(self.root / name)
        self.add(new)
        self._apply_dead(_read_dead(self.root / DEAD))

    def add(self, files: list[tuple[str, int, SegmentHeader, int, int]]) -> None:
        """Segments just written or found: ``(name, generation, header, offset, size)``."""
        if not files:
            return
        numbers = [next(self._numbers) for _ in files]
        starts = self.rows.add([(no, f[2]) for no, f in zip(numbers, files, strict=True)])
        for no, start, (name, gen, h, offset, size) in zip(numbers, starts, files,
                                                           strict=True):
            seg = Segment(name=name, base=name.split(".", 1)[0], gen=gen, start=start,
                          n=h.shape[0], live=h.shape[0], t=h.t, shape=h.shape[1:],
                          offset=offset, disk=self.round(size), block=self.block)
            self.segs[no], self.by_name[name] = seg, no
            self.disk += seg.disk
            self.kept += seg.cost()
            if self._newest is None or name > self._newest:
                self._newest = name

    def forget(self, seg: Segment) -> None:
        """Out of the index (its file is gone or going)."""
        del self.segs[self.by_name.pop(seg.name)]
        self.rows.drop(seg)
        self.disk -= seg.disk
        self.kept -= seg.cost()
        self.dead.pop(seg.name, None)
        if seg.name == self._newest:
            self._newest = max(self.by_name) if self.by_name else None

    def remove(self, seg: Segment) -> None:
        unlink(self.root / seg.name)
        self.forget(seg)

    def mark(self, seg: Segment, rows: list[int]) -> None:
        """Evict ``rows`` of ``seg`` (not all of its kept ones) in memory; :meth:`save_dead`
        makes it stick."""
        self.rows.live[rows] = False
        self.kept -= seg.cost()
        seg.live -= len(rows)
        self.kept += seg.cost()
        marks = set(self.dead.get(seg.name, [])) | {r - seg.start for r in rows}
        self.dead[seg.name] = sorted(marks)

    def save_dead(self) -> None:
        doc = _Dead(dead={k: v for k, v in self.dead.items() if k in self.by_name})
        write_bytes_atomic(self.root / DEAD, doc.model_dump_json().encode())

    def _apply_dead(self, dead: dict[str, list[int]]) -> None:
        for name in set(self.dead) | set(dead):
            no = self.by_name.get(name)
            if no is None or self.dead.get(name) == dead.get(name):
                continue
            seg = self.segs[no]
            idx = sorted({i for i in dead.get(name, []) if 0 <= i < seg.n})
            live = self.rows.live[seg.start: seg.start + seg.n]
            live[:] = True
            live[idx] = False
            self.kept -= seg.cost()
            seg.live = int(live.sum())
            self.kept += seg.cost()
            if idx:
                self.dead[name] = idx
            else:
                self.dead.pop(name, None)

    def compact_rows(self) -> None:
        """Reclaim removed segments' rows once they are half the table (no row index may be
        held across this)."""
        if self.rows.removed > max(4096, self.rows.n // 2):
            self.rows.compact(self.segs)

    def kept_rows(self, seg: Segment) -> np.ndarray:
        return np.flatnonzero(self.rows.live[seg.start: seg.start + seg.n])

    def rewrite(self, seg: Segment) -> None:
        """``seg`` without its evicted samples, as the next generation of its file."""
        header, offset, _ = read_header(self.root / seg.name)
        live = self.kept_rows(seg)
        x = read_samples(self.root / seg.name, header.shape, offset)[live]
        h = SegmentHeader(
            shape=(len(live), *seg.shape), t=header.t, y=[header.y[i] for i in live],
            pseudo=[header.pseudo[i] for i in live],
            margin=[header.margin[i] for i in live],
            entropy=[header.entropy[i] for i in live])
        name = f"{seg.base}.{seg.gen + 1}{SUFFIX}"
        data = encode(h, np.ascontiguousarray(x))
        write_bytes_atomic(self.root / name, data)
        self.remove(seg)
        self.add([(name, seg.gen + 1, h, len(data) - h.data_bytes, len(data))])

    def gather(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every kept sample of the spool's shape, in recording order: x, y, pseudo."""
        shape = self.shape
        xs, rows = [np.zeros((0, *(shape or (1, 1, 1))), np.float32)], [np.zeros(0, np.int64)]
        for name in sorted(self.by_name):
            seg = self.segs[self.by_name[name]]
            if seg.live == 0 or seg.shape != shape:
                continue
            live = self.kept_rows(seg)
            x = read_samples(os.path.join(self.root, name), (seg.n, *seg.shape), seg.offset)
            xs.append(x[live])
            rows.append(seg.start + live)
        r = np.concatenate(rows)
        return np.concatenate(xs), self.rows.y[r].copy(), self.rows.pseudo[r].copy()


def generations(root: Path | str) -> dict[str, list[tuple[int, str]]]:
    """The segment files in ``root`` by segment, ``(generation, file name)`` oldest first (a
    compaction writes the next generation, then deletes the one it replaces)."""
    found: dict[str, list[tuple[int, str]]] = {}
    for name in os.listdir(root):
        m = NAME_RE.match(name)
        if m is not None:
            found.setdefault(m.group(1), []).append((int(m.group(2)), name))
    for gens in found.values():
        gens.sort()
    return found


def count_kept(root: Path) -> int:
    """The samples a snapshot of the spool at ``root`` would hold now (those of its newest
    shape, less the evicted ones), read without its lock and without changing a file: for a
    check when a job is submitted. The fine-tune's snapshot is the count that decides (age
    limits apply there, and recording goes on in between)."""
    newest = {base: gens[-1] for base, gens in generations(root).items()}
    dead = _read_dead(root / DEAD)
    kept: dict[tuple[int, ...], int] = {}
    shape: tuple[int, ...] | None = None
    for _, name in (newest[base] for base in sorted(newest)):  # recording order
        try:
            header, _, _ = read_header(root / name)
        except (OSError, SegmentError):
            continue  # rewritten or removed meanwhile, or not a segment: the snapshot decides
        n, shape = header.shape[0], tuple(header.shape[1:])
        evicted = {i for i in dead.get(name, []) if 0 <= i < n}
        kept[shape] = kept.get(shape, 0) + n - len(evicted)
    return kept.get(shape, 0) if shape is not None else 0


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _read_dead(path: Path) -> dict[str, list[int]]:
    try:
        return _Dead.model_validate_json(path.read_bytes()).dead
    except FileNotFoundError:
        return {}
    except (OSError, ValidationError) as e:
        log.warning("spool: ignoring %s (%s): its evicted samples count as kept until "
                    "evicted again", path, e)
        return {}
