"""Verified chunks by hash, plus partial downloads; the destination of ``registry.pull``.

Layout: ``chunks/sha256/ab/<hash>`` (verified) and ``chunks/partial/<hash>.part``. Every
folder is checked to be a real directory and every file opened without following links.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from agent.storage.nofollow import open_append, read_bytes, real_dirs, regular_file
from registry.errors import ChunkHashError, UnsafeStateError
from registry.manifest import ChunkRef


class ChunkStore:
    """Verified chunks by hash, plus partial downloads.

    Only complete, hash-checked chunks are renamed into ``sha256/``, and every read re-hashes
    the chunk. That read check is what keeps the store honest across power cuts, so chunks are
    not fsynced one by one (an fsync per 4 MiB chunk costs more than the download on eMMC): a
    chunk torn by a power cut is caught, dropped and fetched again. The slot files assembled from
    the chunks are fsynced before ``current`` ever points at them.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.root = self.state_dir / "chunks"
        self.partial_dir = self.root / "partial"

    def path(self, sha256: str) -> Path:
        return self.root / "sha256" / sha256[:2] / sha256

    def partial(self, sha256: str) -> Path:
        return self.partial_dir / f"{sha256}.part"

    def _partials(self) -> Path:
        return real_dirs(self.state_dir, "chunks", "partial")

    def has(self, sha256: str) -> bool:
        real_dirs(self.state_dir, "chunks", "sha256", sha256[:2], create=False)
        return regular_file(self.path(sha256))

    def missing(self, chunks: Iterable[ChunkRef]) -> list[ChunkRef]:
        seen: set[str] = set()
        out = []
        for c in chunks:
            if c.sha256 not in seen and not self.has(c.sha256):
                out.append(c)
            seen.add(c.sha256)
        return out

    def partial_bytes(self, chunks: Iterable[ChunkRef]) -> int:
        total = 0
        for c in chunks:
            with contextlib.suppress(FileNotFoundError):
                total += min(os.lstat(self.partial(c.sha256)).st_size, c.size)
        return total

    # -- registry.pull.ChunkDestination

    def read_partial(self, sha256: str, limit: int) -> bytes:
        self._partials()
        try:
            return read_bytes(self.partial(sha256), limit)
        except FileNotFoundError:
            return b""

    def append_partial(self, sha256: str) -> BinaryIO:
        self._partials()
        return open_append(self.partial(sha256))

    def drop_partial(self, sha256: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.partial(sha256))  # unlink never follows a link: removes the link

    def commit_partial(self, sha256: str) -> None:
        """Make a verified partial file a chunk."""
        dest = self.path(sha256)
        real_dirs(self.state_dir, "chunks", "sha256", sha256[:2])
        # Not registry.atomic: the partial file is itself the temporary file, grown across
        # attempts and process restarts (Range resume) under a fixed name and hashed as it
        # grew; only the rename is left. No fsync here either (see the class docstring).
        os.replace(self.partial(sha256), dest)

    # -- reading, removing, listing

    def read(self, ref: ChunkRef) -> bytes:
        """A chunk's bytes, re-verified; a corrupt or missing chunk is dropped and reported."""
        try:
            real_dirs(self.state_dir, "chunks", "sha256", ref.sha256[:2], create=False)
            data = read_bytes(self.path(ref.sha256))
        except FileNotFoundError:
            raise ChunkHashError(
                f"chunk {ref.sha256[:16]} is missing from the local store {self.root}: pull again",
                ref.sha256,
            ) from None
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            self.remove(ref.sha256)
            raise ChunkHashError(
                f"local chunk {ref.sha256[:16]} is corrupt (disk error or power loss); it was "
                "removed, pull again to fetch it",
                ref.sha256,
            )
        return data

    def remove(self, sha256: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(sha256))

    def entries(self) -> dict[str, int]:
        """Every chunk file: hash -> size. A link among the fan-out folders is refused, so
        garbage collection can never delete through one."""
        base = real_dirs(self.state_dir, "chunks", "sha256", create=False)
        if not base.exists():
            return {}
        out: dict[str, int] = {}
        with os.scandir(base) as fanout:
            for d in fanout:
                if d.is_symlink():
                    raise UnsafeStateError(
                        f"{d.path} is a symbolic link in the chunk store; refusing to follow it: "
                        "remove it and retry"
                    )
                if not d.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(d.path) as files:
                    for f in files:
                        st = f.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                            out[f.name] = st.st_size if stat.S_ISREG(st.st_mode) else 0
        return out

    def hashes(self) -> set[str]:
        return set(self.entries())

    def clear_partials(self) -> None:
        base = real_dirs(self.state_dir, "chunks", "partial", create=False)
        if base.exists():
            with os.scandir(base) as it:
                for entry in it:
                    if not entry.is_dir(follow_symlinks=False):
                        os.unlink(entry.path)  # a link is removed itself, never its target
