"""A verified version's bytes as local chunk files: hashed once, then read by byte range.

A folder registry's chunks are read where they lie; from any other store (HTTP, S3) the
version's chunks are first fetched into a private cache folder by ``registry.pull.download``,
which resumes, retries and checks each chunk's sha256 on the way. Either way
:meth:`LocalBlob.verify` then hashes every chunk file once against the signed manifest and
records its (inode, size, mtime); later reads check that record, so a chunk swapped or
rewritten between verification and use stops the run instead of being averaged.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from registry.errors import ChunkHashError, FetchFailedError, TruncatedError
from registry.manifest import ChunkRef, Manifest
from registry.names import chunk_key
from registry.pull import download
from registry.stores import LocalStore, RegistryStore
from registry.transfer import TransferConfig

PIECE = 1 << 20
"""Bytes hashed and handed on at a time by :meth:`LocalBlob.verify`."""

_Stamp = tuple[int, int, int]


class ChunkChangedError(FetchFailedError):
    """A chunk file changed after it was verified (someone writes into the registry)."""


def _stamp(st: os.stat_result) -> _Stamp:
    return st.st_ino, st.st_size, st.st_mtime_ns


class LocalBlob:
    """The blob of one version (its chunks in manifest order) on local disk."""

    def __init__(self, manifest: Manifest, paths: list[Path], verified: dict[Path, _Stamp]):
        self.manifest = manifest
        self.paths = paths
        self.offsets = manifest.chunk_offsets()
        self._verified = verified
        """Shared by every blob of a run: a chunk several versions hold is hashed once."""
        self._open: tuple[int, BinaryIO] | None = None
        """The chunk file :meth:`read_into` read last, kept open: the combine pass reads
        each update a block at a time in blob order, and opening the file for each of those
        reads cost more than the read (19 us an open, 80,000 reads for 100 updates)."""
        self._lock = threading.Lock()
        """The measuring pass reads a shared release (the base) from several threads: the one
        open file is switched and read under it."""

    def prefetch(self) -> None:
        """Ask the kernel to start reading this blob's chunk files into the page cache
        (``POSIX_FADV_WILLNEED``; returns at once): the first pass hashes one update while the
        disk reads the next, instead of waiting for each read in turn. Advice only: a file
        that cannot be opened here is read (and refused) when its turn comes."""
        for path in self.paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        opened = getattr(self, "_open", None)  # None too for a blob whose __init__ failed
        if opened is not None:
            opened[1].close()
            self._open = None

    def __del__(self) -> None:
        self.close()

    def _chunk_fd(self, i: int) -> int:
        """Chunk ``i`` open for reading, its file checked against the verification record
        (inode, size, mtime) at each use: a chunk swapped (a new inode at the path) or
        rewritten in place (a new mtime) stops the run."""
        path = self.paths[i]
        if _stamp(os.stat(path)) != self._verified.get(path):
            raise ChunkChangedError(
                f"chunk file {path} changed after it was verified (or never was): "
                "something writes into the registry; run again")
        if self._open is None or self._open[0] != i:
            self.close()
            self._open = (i, open(path, "rb", buffering=0))  # noqa: SIM115 - see close()
        return self._open[1].fileno()

    def verify(self, wanted: Callable[[int, int], bool] | None = None,
               ) -> Iterator[tuple[int, memoryview]]:
        """Hash every chunk against the manifest; yield (blob offset, bytes) in blob order,
        ``PIECE`` bytes at a time, so the caller measures what was verified in the same read.
        A chunk verified earlier in the run (one the base holds too) is not hashed again, and
        not even read unless ``wanted(start, end)`` says the caller needs its blob range.
        Raises ChunkHashError / TruncatedError (the caller skips the version)."""
        buf = bytearray(PIECE)
        view = memoryview(buf)
        for ref, start, path in zip(self.manifest.chunks, self.offsets, self.paths, strict=True):
            known = self._verified.get(path)
            h = hashlib.sha256()
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed in the finally below
            except FileNotFoundError:
                raise TruncatedError(f"chunk {ref.sha256[:16]} is missing ({path})") from None
            try:
                stamp = _stamp(os.fstat(f.fileno()))
                if stamp[1] != ref.size:
                    raise TruncatedError(f"chunk {ref.sha256[:16]} holds {stamp[1]} bytes, the "
                                         f"signed manifest says {ref.size} ({path})")
                skip = known is not None and wanted is not None and not wanted(
                    start, start + ref.size)
                done = ref.size if skip else 0
                while done < ref.size:
                    n = f.readinto(view[: min(PIECE, ref.size - done)])
                    if not n:
                        raise TruncatedError(f"chunk {ref.sha256[:16]} ends at byte {done}")
                    if known is None:
                        h.update(view[:n])
                    yield start + done, view[:n]
                    done += n
            finally:
                f.close()
            if known is None:
                if h.hexdigest() != ref.sha256:
                    raise ChunkHashError(
                        f"chunk {ref.sha256[:16]} hashes to {h.hexdigest()[:16]}: the "
                        f"registry's copy ({path}) is not what was signed", ref.sha256)
                self._verified[path] = stamp
            elif known != stamp:
                raise ChunkChangedError(f"chunk file {path} changed during the run")

    def read_into(self, out: np.ndarray, offset: int) -> None:
        """Fill the uint8 array ``out`` with the blob's bytes from ``offset`` on."""
        view = memoryview(out)
        want, pos = len(out), offset
        i = bisect.bisect_right(self.offsets, pos) - 1
        done = 0
        with self._lock:
            while done < want:
                path, start = self.paths[i], self.offsets[i]
                size = self.manifest.chunks[i].size
                n = min(want - done, start + size - pos)
                got = os.preadv(self._chunk_fd(i), [view[done : done + n]], pos - start)
                if got != n:
                    raise ChunkChangedError(f"chunk file {path} is shorter than when verified")
                done += n
                pos += n
                i += 1


class ChunkCache:
    """Verified chunks fetched from a remote store (a ``registry.pull.ChunkDestination``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def _partial(self, sha256: str) -> Path:
        return self.root / f"{sha256}.part"

    def missing(self, chunks: Iterable[ChunkRef]) -> list[ChunkRef]:
        seen: set[str] = set()
        out = []
        for c in chunks:
            if c.sha256 not in seen and not self.path(c.sha256).is_file():
                out.append(c)
            seen.add(c.sha256)
        return out

    def read_partial(self, sha256: str, limit: int) -> bytes:
        try:
            with open(self._partial(sha256), "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return b""

    def append_partial(self, sha256: str) -> BinaryIO:
        return open(self._partial(sha256), "ab")  # the caller closes it

    def drop_partial(self, sha256: str) -> None:
        self._partial(sha256).unlink(missing_ok=True)

    def commit_partial(self, sha256: str) -> None:
        os.replace(self._partial(sha256), self.path(sha256))


def local_blob(store: RegistryStore, manifest: Manifest, cache: ChunkCache | None,
               cfg: TransferConfig, verified: dict[Path, _Stamp]) -> LocalBlob:
    """The version's chunks as local files: in place for a folder registry, else fetched."""
    if isinstance(store, LocalStore):
        paths = [store.path(chunk_key(c.sha256)) for c in manifest.chunks]
        return LocalBlob(manifest, paths, verified)
    if cache is None:
        raise ValueError("a remote registry needs a chunk cache")
    download(store, cache, cache.missing(manifest.chunks), cfg)
    return LocalBlob(manifest, [cache.path(c.sha256) for c in manifest.chunks], verified)
