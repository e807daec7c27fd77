"""Pull a signed model version from a registry: verify the manifest, then fetch missing chunks.

Order of operations, each a gate for the next:

1. fetch ``manifest.json`` + ``manifest.sig`` and verify the signature against the trusted
   keys, then the manifest's schema, names and tiling, then the verifying key's scope - all
   BEFORE a single chunk is requested (:func:`fetch_verified_manifest`);
2. the caller checks what only it knows: the model spec (needs torch: the device runs it in a
   child process), the highest sequence it installed, free disk (``agent.storage.update``);
3. fetch only the missing chunks (delta) into a :class:`ChunkDestination`, resuming partial
   ones with HTTP Range, verifying each chunk's sha256 before it is committed; every request
   runs under :func:`registry.transfer.with_retries` (deadline, back-off, minimum rate).

Nothing here holds more than one read buffer per connection: chunks stream to disk.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from registry.errors import (
    ChunkHashError,
    FetchFailedError,
    ManifestMismatchError,
    PickleRefusedError,
    RefError,
    ResumeMismatchError,
    StoreError,
    StoreTransientError,
    TruncatedError,
)
from registry.manifest import MAX_MANIFEST_BYTES, ChunkRef, Manifest
from registry.names import chunk_key, manifest_key, signature_key
from registry.refs import Ref
from registry.safetensors_io import PICKLE_SUFFIXES
from registry.signing import MAX_SIGNATURE_BYTES, TrustedKey, verify_signed_manifest
from registry.stores import RegistryStore
from registry.stores.http_transport import READ_BUF
from registry.transfer import Deadline, RateLimiter, TransferConfig, with_retries

Progress = Callable[[int, int], None]
"""progress(done_bytes, total_bytes) for the chunks being downloaded."""


@dataclass(frozen=True)
class VerifiedManifest:
    manifest: Manifest
    manifest_bytes: bytes
    signature_bytes: bytes
    key: TrustedKey
    """The trusted key that verified the signature (not the signer the manifest claims)."""


def fetch_verified_manifest(
    source: RegistryStore, ref: Ref, trusted: dict[str, TrustedKey], cfg: TransferConfig
) -> VerifiedManifest:
    """Manifest and signature, checked against the trusted keys, their scopes and the ref."""
    mkey, skey = manifest_key(ref.name, ref.version), signature_key(ref.name, ref.version)

    def get(key: str, limit: int) -> bytes | None:
        return with_retries(lambda d: source.get(key, limit, d), cfg, f"GET {key}")

    try:
        manifest_bytes = get(mkey, MAX_MANIFEST_BYTES)
        signature_bytes = get(skey, MAX_SIGNATURE_BYTES) if manifest_bytes is not None else None
    except StoreError as e:
        raise FetchFailedError(f"{ref}: {e}") from e
    if manifest_bytes is None:
        raise RefError(f"{ref}: no such version (no {mkey})")
    label = f"{ref.name}@{ref.version}"
    manifest, key = verify_signed_manifest(manifest_bytes, signature_bytes, trusted, label)
    if (manifest.name, manifest.version) != (ref.name, ref.version):
        raise ManifestMismatchError(
            f"asked for {ref.name}@{ref.version}, the signed manifest is {manifest.ref}: the "
            "registry serves a different version under this path"
        )
    for a in manifest.artefacts:
        if a.path.lower().endswith(PICKLE_SUFFIXES):
            raise PickleRefusedError(
                f"{manifest.ref}: artefact {a.path} is a pickle container; never installed"
            )
    return VerifiedManifest(manifest, manifest_bytes, signature_bytes or b"", key)


class ChunkDestination(Protocol):
    """Where verified chunks go (the device's chunk store); partial files are its business,
    including refusing to follow a symlink planted where a partial file should be."""

    def missing(self, chunks: Iterable[ChunkRef]) -> list[ChunkRef]: ...

    def read_partial(self, sha256: str, limit: int) -> bytes:
        """What an earlier attempt left (b'' if nothing), at most ``limit`` bytes."""

    def append_partial(self, sha256: str) -> BinaryIO: ...

    def drop_partial(self, sha256: str) -> None: ...

    def commit_partial(self, sha256: str) -> None:
        """The partial file verified: make it the chunk."""


class _Cancelled(Exception):
    pass


@dataclass
class _Partial:
    """A chunk being downloaded: how much is on disk, and its running hash. Every byte written
    is hashed in the same step, so a retry resumes exactly at ``have``."""

    sha256: str
    hasher: Any
    have: int

    @classmethod
    def resume(cls, dest: ChunkDestination, ref: ChunkRef) -> _Partial:
        data = dest.read_partial(ref.sha256, ref.size + 1)
        if len(data) > ref.size:
            dest.drop_partial(ref.sha256)
            data = b""
        return cls(ref.sha256, hashlib.sha256(data), len(data))

    def restart(self, dest: ChunkDestination) -> None:
        dest.drop_partial(self.sha256)
        self.hasher, self.have = hashlib.sha256(), 0


class Downloads:
    """Fetch chunks into a destination with resume, verification, retries; several at a time."""

    def __init__(self, source: RegistryStore, dest: ChunkDestination, cfg: TransferConfig,
                 total: int, progress: Progress | None = None) -> None:
        self.source, self.dest, self.cfg = source, dest, cfg
        self.limiter = RateLimiter(cfg.max_bytes_per_s) if cfg.max_bytes_per_s else None
        self.stop = threading.Event()
        self.total, self.done = total, 0
        self.downloaded = 0
        """Bytes moved over the network in this run (resumed bytes are not counted twice)."""
        self._progress = progress
        self._lock = threading.Lock()

    def _moved(self, n: int) -> None:
        with self._lock:
            self.done += n
            self.downloaded += n
            if self._progress is not None:
                self._progress(self.done, self.total)

    def run(self, chunks: list[ChunkRef]) -> None:
        if not chunks:
            return
        workers = min(self.cfg.connections, len(chunks))
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="chunk") as pool:
                futures = [pool.submit(self.fetch, c) for c in chunks]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                if any(f.exception() is not None for f in done):
                    self.stop.set()
                    wait(futures)
                    errors = [f.exception() for f in futures if f.exception() is not None]
                    first = next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])
                    raise first  # type: ignore[misc]
        finally:
            self.source.close()

    def fetch(self, ref: ChunkRef) -> None:
        part = _Partial.resume(self.dest, ref)
        with self._lock:
            self.done += part.have
        bad_hashes = 0
        while True:
            if part.have < ref.size:
                with_retries(lambda d: self._attempt(ref, part, d), self.cfg,
                             f"chunk {ref.sha256[:16]}", progress=lambda: part.have,
                             stop=self.stop)
            digest = part.hasher.hexdigest()
            if digest == ref.sha256:
                self.dest.commit_partial(ref.sha256)
                return
            # A corrupt partial (power cut) or bad bytes from a proxy: start over once, then
            # believe it is the registry's copy that is bad.
            bad_hashes += 1
            self._restart(part)
            if bad_hashes > 1:
                raise ChunkHashError(
                    f"chunk {ref.sha256[:16]} from {self.source.uri}: the bytes served hash to "
                    f"{digest[:16]}…, not the signed {ref.sha256[:16]}…; the registry's copy "
                    "is corrupt: republish the version", ref.sha256,
                )

    def _restart(self, part: _Partial) -> None:
        with self._lock:
            self.done -= part.have
        part.restart(self.dest)

    def _attempt(self, ref: ChunkRef, part: _Partial, deadline: Deadline) -> None:
        if self.stop.is_set():
            raise _Cancelled
        try:
            reader = self.source.open_range(chunk_key(ref.sha256), part.have, deadline)
        except ResumeMismatchError:
            # The server answered the resume for other bytes: what we hold cannot be
            # continued; drop it and let the retry fetch the chunk from its first byte.
            self._restart(part)
            raise
        try:
            if reader.size != ref.size:
                raise TruncatedError(
                    f"chunk {ref.sha256[:16]}: the registry holds {reader.size} bytes, the signed "
                    f"manifest says {ref.size}: the registry copy is truncated or wrong"
                )
            bufsize = READ_BUF
            if self.limiter is not None:  # small reads keep a capped link smooth
                bufsize = max(16 << 10, min(bufsize, int(self.limiter.rate) // 20))
            buf = memoryview(bytearray(bufsize))
            with self.dest.append_partial(ref.sha256) as out:
                while part.have < ref.size:
                    if self.stop.is_set():
                        raise _Cancelled
                    n = reader.readinto(buf[: min(bufsize, ref.size - part.have)])
                    if n == 0:
                        raise StoreTransientError(f"chunk {ref.sha256[:16]}: stream ended early")
                    piece = buf[:n]
                    out.write(piece)
                    part.hasher.update(piece)
                    part.have += n
                    self._moved(n)
                    if self.limiter is not None:
                        self.limiter.take(n)
        finally:
            reader.close()


def download(
    source: RegistryStore, dest: ChunkDestination, chunks: list[ChunkRef], cfg: TransferConfig,
    *, total: int | None = None, progress: Progress | None = None,
) -> int:
    """Fetch ``chunks`` into ``dest``; returns the bytes moved over the network."""
    downloads = Downloads(source, dest, cfg, total or sum(c.size for c in chunks), progress)
    try:
        downloads.run(chunks)
    except StoreError as e:
        raise FetchFailedError(f"{source.uri}: {e}") from e
    return downloads.downloaded
