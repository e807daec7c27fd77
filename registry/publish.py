"""Publish model versions into a registry (folder, S3, or HTTP that takes PUT).

Objects are immutable once written (a chunk's key is its hash, a version is never
overwritten), which is what makes caching and resuming safe everywhere. Write order makes a
half-published version invisible: chunks first, then ``manifest.sig``, then
``manifest.json``; a reader that finds the manifest finds everything it names.

Each version gets the next ``sequence`` of its model: one above both the registry's counter
(``NAME/_sequence.json``, written after the manifest) and the parent's sequence. The counter
is a convenience for the publisher, not trusted data: devices trust only the signed number.
``registry.serve`` assigns sequences atomically: when another upload took the number first it
answers the manifest with 409, and the version is signed again with the next number. A folder
or S3 registry cannot tell, so there one publisher per model name at a time is assumed (two
racing publishers could assign the same sequence; a device then accepts either, never a
lower one).

Reading an hpc_core checkpoint needs torch and lives in ``hpc_core.model_spec``; this module
takes what it read as a :class:`VersionContent`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from registry.chunks import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PACK_BELOW,
    ArtefactSource,
    artefact_sources,
    lay_out,
)
from registry.errors import (
    MalformedJsonError,
    PublishError,
    RefusedError,
    StoreConflictError,
    VersionExistsError,
)
from registry.jsonsafe import loads_strict
from registry.manifest import (
    MAX_MANIFEST_BYTES,
    BaseRelease,
    ChunkRef,
    LayoutRecord,
    Manifest,
    TrainingInfo,
    utc_now,
)
from registry.model_config import ModelConfig
from registry.names import (
    check_model_name,
    check_version,
    chunk_key,
    manifest_key,
    sequence_key,
    signature_key,
)
from registry.safetensors_io import FileRange, TensorSource, refuse_pickled_file
from registry.signing import SigningKey
from registry.stores import RegistryStore


@dataclass(frozen=True)
class VersionContent:
    """What a version is made of, read from a checkpoint (``hpc_core.model_spec``)."""

    path: Path
    model: ModelConfig
    training: TrainingInfo
    tensors: list[TensorSource]
    layout: LayoutRecord | None = None
    """The tensors the spec builds, for a torchvision/timm model (see Manifest.layout)."""


@dataclass(frozen=True)
class SignedVersion:
    manifest: Manifest
    manifest_bytes: bytes
    signature_bytes: bytes


@dataclass(frozen=True)
class PublishReport:
    manifest: Manifest
    uri: str
    chunks_written: int
    bytes_written: int
    chunks_reused: int
    bytes_reused: int

    def summary(self) -> str:
        m = self.manifest
        return (
            f"published {m.ref} (sequence {m.sequence}) to {self.uri}: {len(m.tensors)} tensors, "
            f"{len(m.artefacts)} artefacts, {m.total_bytes / 1e6:.1f} MB in {len(m.chunks)} "
            f"chunks; wrote {self.chunks_written} new chunks ({self.bytes_written / 1e6:.1f} MB), "
            f"reused {self.chunks_reused} ({self.bytes_reused / 1e6:.1f} MB); signed by "
            f"{m.signer.name} ({m.signer.key_id})"
        )


ChunkSink = Callable[[ChunkRef, bytes], None]
ChunkProgress = Callable[[ChunkRef, bool], None]
"""Called per chunk with (chunk, written): written is False when the registry had it."""


def sign_version(
    *,
    name: str,
    version: str,
    sequence: int,
    model: ModelConfig,
    tensors: Sequence[TensorSource],
    key: SigningKey,
    on_chunk: ChunkSink,
    parent: str | None = None,
    base: BaseRelease | None = None,
    training: TrainingInfo | None = None,
    artefacts: Sequence[ArtefactSource] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pack_below: int = DEFAULT_PACK_BELOW,
    spec_layout: LayoutRecord | None = None,
) -> SignedVersion:
    """Cut the content into chunks (each handed to ``on_chunk``), then build and sign the
    manifest. Publishing and a device staging its own fine-tune both go through here."""
    try:
        check_model_name(name)
        check_version(version)
        if parent is not None:
            check_version(parent)
    except ValueError as e:
        raise PublishError(str(e)) from None
    for a in artefacts:
        refuse_pickled_file(a.data.path, f"artefact {a.path} ({a.data.path})")
    layout = lay_out(tensors, artefacts, chunk_size=chunk_size, pack_below=pack_below,
                     on_chunk=on_chunk)
    manifest = Manifest(
        name=name, version=version, sequence=sequence, parent=parent, base=base,
        created_at=utc_now(),
        signer=key.signer, model=model, training=training or TrainingInfo(),
        chunk_size=chunk_size, pack_below=pack_below, chunks=layout.chunks,
        tensors=layout.tensors, artefacts=layout.artefacts, layout=spec_layout,
    )
    manifest_bytes = manifest.to_bytes()
    return SignedVersion(manifest, manifest_bytes, key.sign_manifest(manifest_bytes))


def published_sequence(store: RegistryStore, name: str) -> int:
    """The registry's counter for ``name`` (0 when none was published there)."""
    data = store.get(sequence_key(name), 4096)
    if data is None:
        return 0
    try:
        doc = loads_strict(data, f"{store.uri}/{sequence_key(name)}")
        value = doc["sequence"]
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"sequence {value!r}")
    except (MalformedJsonError, KeyError, TypeError, ValueError) as e:
        raise PublishError(
            f"{store.uri}/{sequence_key(name)} is unreadable ({e}): restore it, or write "
            '{"sequence": N} with N the highest sequence published for this model'
        ) from None
    return value


def parent_sequence(store: RegistryStore, name: str, parent: str) -> int:
    """The signed sequence of ``name@parent`` in ``store``; the parent must exist there."""
    data = store.get(manifest_key(name, parent), MAX_MANIFEST_BYTES)
    if data is None:
        raise PublishError(f"parent {name}@{parent} is not in {store.uri}: publish it first")
    try:
        return Manifest.from_bytes(data, source=f"{name}@{parent}").sequence
    except RefusedError as e:
        raise PublishError(f"parent {name}@{parent} in {store.uri} is unreadable: {e}") from None


def publish_version(
    store: RegistryStore,
    *,
    name: str,
    version: str,
    model: ModelConfig,
    tensors: Sequence[TensorSource],
    key: SigningKey,
    parent: str | None = None,
    parent_seq: int = 0,
    base: BaseRelease | None = None,
    training: TrainingInfo | None = None,
    artefacts: Sequence[ArtefactSource] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pack_below: int = DEFAULT_PACK_BELOW,
    known_chunks: Iterable[str] = (),
    on_chunk: ChunkProgress | None = None,
    spec_layout: LayoutRecord | None = None,
) -> PublishReport:
    """Write the chunks the store lacks, then the signature, then the manifest.

    The sequence is one above both the registry's counter and ``parent_seq`` (the parent's
    signed sequence, which a device knows even when uploading to another registry).
    ``known_chunks`` are hashes the caller knows the store holds (the parent's chunks): they
    are not even asked about, which saves a request per chunk on a slow uplink.
    """
    try:
        check_model_name(name)
        check_version(version)
    except ValueError as e:
        raise PublishError(str(e)) from None
    if store.exists(manifest_key(name, version)):
        raise VersionExistsError(
            f"{name}@{version} already exists in {store.uri}; versions are immutable, "
            "pick a new one"
        )
    sequence = max(published_sequence(store, name), parent_seq) + 1
    present = set(known_chunks)
    counts = {"written": 0, "bytes_written": 0, "reused": 0, "bytes_reused": 0}

    def put_chunk(ref: ChunkRef, data: bytes) -> None:
        written = False
        if ref.sha256 not in present and not store.exists(chunk_key(ref.sha256)):
            store.put(chunk_key(ref.sha256), data)
            written = True
        present.add(ref.sha256)
        counts["written" if written else "reused"] += 1
        counts["bytes_written" if written else "bytes_reused"] += ref.size
        if on_chunk is not None:
            on_chunk(ref, written)

    signed = sign_version(
        name=name, version=version, sequence=sequence, model=model, tensors=tensors, key=key,
        on_chunk=put_chunk, parent=parent, base=base, training=training, artefacts=artefacts,
        chunk_size=chunk_size, pack_below=pack_below, spec_layout=spec_layout,
    )
    signed = _commit(store, signed, key, parent_seq)
    sequence = signed.manifest.sequence
    store.put(sequence_key(name), json.dumps({"sequence": sequence, "version": version}).encode())
    return PublishReport(
        signed.manifest, store.uri, counts["written"], counts["bytes_written"], counts["reused"],
        counts["bytes_reused"],
    )


_SEQUENCE_RACES = 64
"""Re-signings after lost sequence races before giving up; each loss means another upload of
the same model committed, so this bounds only a registry that keeps refusing."""


def resign(signed: SignedVersion, sequence: int, key: SigningKey) -> SignedVersion:
    """The same version under another sequence number, signed again."""
    manifest = signed.manifest.model_copy(update={"sequence": sequence})
    manifest_bytes = manifest.to_bytes()
    return SignedVersion(manifest, manifest_bytes, key.sign_manifest(manifest_bytes))


def _commit(store: RegistryStore, signed: SignedVersion, key: SigningKey,
            parent_seq: int) -> SignedVersion:
    """Write the signature, then the manifest (last: now the version exists). Returns what was
    committed, re-signed with a later sequence if the registry said another upload took it."""
    m = signed.manifest
    for _ in range(_SEQUENCE_RACES):
        try:
            store.put(signature_key(m.name, m.version), signed.signature_bytes)
            store.put(manifest_key(m.name, m.version), signed.manifest_bytes)
            return signed
        except StoreConflictError as e:
            if store.exists(manifest_key(m.name, m.version)):
                raise VersionExistsError(
                    f"{m.ref} already exists in {store.uri}; versions are immutable, pick a "
                    "new one"
                ) from e
            highest = published_sequence(store, m.name)
            if highest < m.sequence:  # not a lost race: the registry refused it for cause
                raise PublishError(f"{m.ref}: {e}") from e
            signed = resign(signed, max(highest, parent_seq) + 1, key)
            m = signed.manifest
    raise PublishError(f"{m.ref}: the registry refused {_SEQUENCE_RACES} sequence numbers in "
                       f"a row; last tried {m.sequence}")


def collect_artefacts(paths: Iterable[Path]) -> list[ArtefactSource]:
    """A file becomes an artefact named by its file name; a folder, its files under its name."""
    out: list[ArtefactSource] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += artefact_sources(p, prefix=p.name)
        elif p.is_file():
            out.append(ArtefactSource(p.name, FileRange(p, 0, p.stat().st_size)))
        else:
            raise PublishError(f"artefact {p} does not exist")
    names = [a.path for a in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PublishError(f"two artefacts would be stored as {dupes[0]!r}: rename one")
    return out


def publish_content(
    content: VersionContent,
    store: RegistryStore,
    *,
    name: str,
    version: str,
    key: SigningKey,
    parent: str | None = None,
    artefacts: Iterable[Path] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pack_below: int = DEFAULT_PACK_BELOW,
) -> PublishReport:
    """Publish a checkpoint's content as ``name@version`` (the parent must be in the store)."""
    parent_seq = 0
    if parent is not None:
        try:
            check_model_name(name)
            check_version(parent)
        except ValueError as e:
            raise PublishError(str(e)) from None
        parent_seq = parent_sequence(store, name, parent)
    return publish_version(
        store, name=name, version=version, parent=parent, parent_seq=parent_seq,
        model=content.model, training=content.training, tensors=content.tensors,
        artefacts=collect_artefacts(artefacts), key=key, chunk_size=chunk_size,
        pack_below=pack_below, spec_layout=content.layout,
    )
