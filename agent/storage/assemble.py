"""Assemble a verified version from the chunk store into a slot folder, in one pass."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from agent.storage.chunk_store import ChunkStore
from agent.storage.nofollow import open_new, real_dirs
from registry.atomic import fsync_dir
from registry.errors import CorruptSlotError, IntegrityError, TensorHashError
from registry.manifest import Manifest
from registry.safetensors_io import (
    read_safetensors_index,
    refuse_pickled_file,
    safetensors_header,
)

MODEL_FILE = "model.safetensors"
ARTEFACTS_DIR = "artefacts"


class _Region:
    """One tensor or artefact being written while chunks stream by."""

    def __init__(
        self,
        offset: int,
        nbytes: int,
        sha256: str,
        label: str,
        out: Any,
        error: type[IntegrityError],
    ) -> None:
        self.offset, self.end, self.sha256, self.label = offset, offset + nbytes, sha256, label
        self.out, self.error = out, error
        self.hash = hashlib.sha256()

    def finish(self) -> None:
        digest = self.hash.hexdigest()
        if digest != self.sha256:
            raise self.error(
                f"{self.label}: sha256 {digest[:16]}… differs from the signed manifest's "
                f"{self.sha256[:16]}… although every chunk verified: the manifest is inconsistent"
            )


def assemble(manifest: Manifest, chunks: ChunkStore, dest: Path) -> None:
    """One pass over the chunks: write model.safetensors and the artefacts, verifying every
    chunk, tensor and artefact hash on the way. Memory: one chunk."""
    model_path = dest / MODEL_FILE
    files: list[Any] = []
    try:
        model_file = open_new(model_path)  # closed in finally with the rest
        files.append(model_file)
        metadata = {"format": "pt", "edgetrain.ref": manifest.ref}
        model_file.write(safetensors_header(manifest.tensors, metadata))
        regions = [
            _Region(t.offset, t.nbytes, t.sha256, f"tensor {t.name}", model_file, TensorHashError)
            for t in manifest.tensors
        ]
        art_root = dest / ARTEFACTS_DIR
        for a in manifest.artefacts:
            path = art_root / a.path
            # Names were validated at parse time; this re-check guards against a future bug there.
            if not path.resolve().is_relative_to(art_root.resolve()):
                raise CorruptSlotError(f"artefact {a.path} would land outside the slot")
            real_dirs(dest, ARTEFACTS_DIR, *a.path.split("/")[:-1])
            f = open_new(path)
            files.append(f)
            regions.append(
                _Region(a.offset, a.nbytes, a.sha256, f"artefact {a.path}", f, IntegrityError)
            )
        regions.sort(key=lambda r: r.offset)
        _stream_chunks(manifest, chunks, regions)
        for f in files:
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files:
            f.close()
    for a in manifest.artefacts:
        refuse_pickled_file(dest / ARTEFACTS_DIR / a.path, f"artefact {a.path} of {manifest.ref}")
    # The file we wrote must parse back as safetensors with exactly the manifest's tensors.
    index = read_safetensors_index(model_path)
    if [(t.name, t.dtype, tuple(t.shape)) for t in index] != [
        (t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors
    ]:
        raise CorruptSlotError(f"{model_path} does not read back as the manifest's tensors")
    for d in sorted({p.parent for p in dest.rglob("*") if p.is_file()} | {dest}, reverse=True):
        fsync_dir(d)


def _stream_chunks(manifest: Manifest, chunks: ChunkStore, regions: list[_Region]) -> None:
    it = iter(regions)
    region = next(it, None)
    pos = 0
    while region is not None and region.end == region.offset:  # zero-size tensors
        region.finish()
        region = next(it, None)
    for ref in manifest.chunks:
        view = memoryview(chunks.read(ref))
        i = 0
        while i < len(view):
            assert region is not None  # the manifest's tiling check guarantees coverage
            take = min(region.end - pos, len(view) - i)
            piece = view[i : i + take]
            region.out.write(piece)
            region.hash.update(piece)
            i += take
            pos += take
            while region is not None and pos == region.end:
                region.finish()
                region = next(it, None)
