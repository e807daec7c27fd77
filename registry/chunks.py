"""Chunk layout: how a version's tensors and artefacts are cut into content-addressed chunks.

The blob is laid out by a fixed rule, so identical tensor bytes always give identical chunks:

1. tensors smaller than ``pack_below`` bytes, sorted by name, are packed into one segment
   (biases and norm statistics: thousands of tiny requests would cost more than they save);
2. every other tensor, sorted by name, is a segment of its own;
3. every artefact, sorted by path, is a segment of its own;

and each segment is cut into ``chunk_size`` pieces, the last one shorter. A chunk therefore
never spans two large tensors: a changed tensor changes only its own chunks, and re-publishing
an unchanged tensor gives chunk hashes the registry already holds.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from registry.errors import TruncatedError
from registry.manifest import ArtefactEntry, ChunkRef, TensorEntry
from registry.names import check_artefact_path, check_tensor_name
from registry.safetensors_io import FileRange, TensorSource

DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_PACK_BELOW = 64 << 10



@dataclass(frozen=True)
class ArtefactSource:
    path: str
    data: FileRange


@dataclass(frozen=True)
class Layout:
    chunks: tuple[ChunkRef, ...]
    tensors: tuple[TensorEntry, ...]
    artefacts: tuple[ArtefactEntry, ...]


ChunkSink = Callable[[ChunkRef, bytes], None]
_READ_BLOCK = 1 << 20


def lay_out(
    tensors: Iterable[TensorSource],
    artefacts: Iterable[ArtefactSource] = (),
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pack_below: int = DEFAULT_PACK_BELOW,
    on_chunk: ChunkSink | None = None,
) -> Layout:
    """Cut tensors and artefacts into chunks by the module's rule, hashing as it reads.

    ``on_chunk(ref, data)`` sees every chunk in blob order (to upload the ones a registry
    lacks); memory stays at one chunk whatever the model size.
    """
    tensors = sorted(tensors, key=lambda t: t.name)
    arts = sorted(artefacts, key=lambda a: a.path)
    for t in tensors:
        check_tensor_name(t.name)
    for a in arts:
        check_artefact_path(a.path)
    # Segments of (key, bytes); key = ("t", tensor name) or ("a", artefact path).
    small = [(("t", t.name), t.data) for t in tensors if t.data.nbytes < pack_below]
    segments = [small] if small else []
    segments += [[(("t", t.name), t.data)] for t in tensors if t.data.nbytes >= pack_below]
    segments += [[(("a", a.path), a.data)] for a in arts]

    cutter = _Cutter(chunk_size, on_chunk)
    offsets: dict[tuple[str, str], int] = {}
    hashes: dict[tuple[str, str], str] = {}
    for segment in segments:
        for key, rng in segment:
            offsets[key] = cutter.position
            hashes[key] = cutter.feed(rng)
        cutter.end_segment()

    # Blob order, which is also the order tensors appear in an assembled safetensors file.
    tensor_entries = sorted(
        (
            TensorEntry(
                name=t.name, dtype=t.dtype, shape=t.shape,  # type: ignore[arg-type]
                offset=offsets["t", t.name], nbytes=t.data.nbytes, sha256=hashes["t", t.name],
            )
            for t in tensors
        ),
        key=lambda e: e.offset,
    )
    artefact_entries = [
        ArtefactEntry(path=a.path, offset=offsets["a", a.path], nbytes=a.data.nbytes,
                      sha256=hashes["a", a.path])
        for a in arts
    ]
    return Layout(tuple(cutter.chunks), tuple(tensor_entries), tuple(artefact_entries))


class _Cutter:
    """Accumulates bytes into chunk_size pieces; a segment end closes the current chunk."""

    def __init__(self, chunk_size: int, on_chunk: ChunkSink | None) -> None:
        self.chunk_size = chunk_size
        self.on_chunk = on_chunk
        self.chunks: list[ChunkRef] = []
        self.position = 0
        self._buf = bytearray()

    def feed(self, rng: FileRange) -> str:
        """Append a file range; return its sha256."""
        h = hashlib.sha256()
        with open(rng.path, "rb") as f:
            f.seek(rng.start)
            left = rng.nbytes
            while left:
                piece = f.read(min(left, self.chunk_size - len(self._buf), _READ_BLOCK))
                if not piece:
                    raise TruncatedError(f"{rng.path}: ends before byte {rng.start + rng.nbytes}")
                h.update(piece)
                self._buf += piece
                left -= len(piece)
                self.position += len(piece)
                if len(self._buf) == self.chunk_size:
                    self.end_segment()
        return h.hexdigest()

    def end_segment(self) -> None:
        if not self._buf:
            return
        data = bytes(self._buf)
        self._buf = bytearray()
        ref = ChunkRef(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        self.chunks.append(ref)
        if self.on_chunk is not None:
            self.on_chunk(ref, data)


def artefact_sources(root: Path, prefix: str = "") -> list[ArtefactSource]:
    """Every regular file under ``root`` as an artefact named ``prefix/relative/path``."""
    root = Path(root)
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for fname in files:
            p = Path(dirpath) / fname
            if p.is_symlink() or not p.is_file():
                continue
            rel = p.relative_to(root).as_posix()
            name = f"{prefix}/{rel}" if prefix else rel
            out.append(ArtefactSource(name, FileRange(p, 0, p.stat().st_size)))
    return out
