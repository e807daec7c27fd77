"""Garbage collection of the chunk store: keep exactly what complete slots reference."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agent.storage.chunk_store import ChunkStore
from agent.storage.lock import StateLock
from agent.storage.nofollow import real_dirs
from agent.storage.slots import SLOT_NAMES, ModelSlots, read_installed


def installed_models(state_dir: Path) -> list[str]:
    models = real_dirs(Path(state_dir), "models", create=False)
    if not models.is_dir():
        return []
    with os.scandir(models) as it:
        return sorted(
            e.name for e in it if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
        )


@dataclass(frozen=True)
class GcReport:
    removed_chunks: int
    removed_bytes: int
    kept_chunks: int


def gc(state_dir: Path) -> GcReport:
    """Delete chunks no complete slot of any model references, partial downloads, leftovers.

    Deletion never goes through a link: chunk files are unlinked (which removes a link
    itself), and a linked fan-out folder or slot is refused before anything is deleted.
    """
    with StateLock(state_dir):
        keep: set[str] = set()
        for name in installed_models(state_dir):
            slots = ModelSlots(state_dir, name)
            slots.clean_leftovers()
            for s in SLOT_NAMES:
                installed = read_installed(slots.slots_dir / s, s)
                if installed is not None:
                    keep |= {c.sha256 for c in installed.manifest.chunks}
        store = ChunkStore(state_dir)
        removed = removed_bytes = 0
        for sha, size in store.entries().items():
            if sha in keep:
                continue
            os.unlink(store.path(sha))
            removed_bytes += size
            removed += 1
        store.clear_partials()
        return GcReport(removed, removed_bytes, len(keep))
