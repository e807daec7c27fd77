"""Publish checkpoints into a model registry: a local folder or S3-compatible storage.

A local registry folder is exactly what a static HTTP server or a CDN serves; devices pull from
it over HTTP(S). Objects are immutable once written (a chunk's key is its hash, a version is
never overwritten), which is what makes caching and resuming safe everywhere.

Write order makes a half-published version invisible: chunks first, then ``manifest.sig``, then
``manifest.json``; a reader that finds the manifest finds everything it names.

The stores here are also what the device reads ``file://`` and ``s3://`` registries through, so
this module must not import torch at module level.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from hpc_core.manifest import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PACK_BELOW,
    ArtefactSource,
    ChunkRef,
    FileRange,
    Manifest,
    ModelSpec,
    TensorSource,
    TrainingInfo,
    artefact_sources,
    check_model_name,
    check_version,
    chunk_key,
    lay_out,
    manifest_key,
    read_safetensors_index,
    refuse_pickled_file,
    signature_key,
    utc_now,
)
from hpc_core.signing import SigningKey

# ---------------------------------------------------------------------------------------------
# Store errors: the sync and upload code retries the transient ones.


class StoreError(Exception):
    """A registry request failed in a way that retrying will not fix."""


class StoreNotFoundError(StoreError):
    """The object does not exist in the registry."""


class StoreTransientError(StoreError):
    """A network or server hiccup: worth retrying after a back-off."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PublishError(Exception):
    """The version could not be published (bad input or registry state)."""


class VersionExistsError(PublishError):
    """Versions are immutable; this one is already in the registry."""


class RangeReader(Protocol):
    size: int
    """Total size of the object (not of the remaining range)."""

    def readinto(self, buf: memoryview) -> int: ...

    def close(self) -> None: ...


class RegistryStore(Protocol):
    uri: str

    def exists(self, key: str) -> bool: ...

    def get(self, key: str, max_bytes: int) -> bytes | None:
        """The whole object, or None when it does not exist."""

    def put(self, key: str, data: bytes) -> None:
        """Write an object atomically: readers see all of it or nothing."""

    def open_range(self, key: str, start: int) -> RangeReader:
        """Stream the object from byte ``start`` to its end."""


# ---------------------------------------------------------------------------------------------
# Local folder


def _safe_key(key: str) -> str:
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"registry key {key!r} is not a plain relative path")
    return key


class _FileRange:
    def __init__(self, path: Path, start: int) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - handed to the caller, closed by close()
        self.size = os.fstat(self._f.fileno()).st_size
        self._f.seek(start)

    def readinto(self, buf: memoryview) -> int:
        return self._f.readinto(buf)

    def close(self) -> None:
        self._f.close()


class LocalStore:
    """A registry in a local (or mounted) folder."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.uri = self.root.resolve().as_uri()

    def path(self, key: str) -> Path:
        return self.root / _safe_key(key)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def get(self, key: str, max_bytes: int) -> bytes | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                data = f.read(max_bytes + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {p}: {e.strerror}") from None
        if len(data) > max_bytes:
            raise StoreError(f"{p} is over the {max_bytes}-byte limit for this object")
        return data

    def put(self, key: str, data: bytes) -> None:
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".tmp-{dest.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                tmp.unlink()
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_range(self, key: str, start: int) -> RangeReader:
        try:
            return _FileRange(self.path(key), start)
        except FileNotFoundError:
            raise StoreNotFoundError(f"{self.path(key)} does not exist") from None
        except OSError as e:
            raise StoreTransientError(f"cannot read {self.path(key)}: {e.strerror}") from None


# ---------------------------------------------------------------------------------------------
# S3-compatible storage (optional extra)


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise StoreError(
            "s3:// registries need boto3, which is not installed: pip install 'edgetrain[s3]' "
            "(or pip install boto3)"
        ) from None
    return boto3


class _S3Range:
    def __init__(self, body: Any, size: int) -> None:
        self._body = body
        self.size = size

    def readinto(self, buf: memoryview) -> int:
        try:
            data = self._body.read(len(buf))
        except Exception as e:  # botocore/urllib3 raise many unrelated types mid-stream
            raise StoreTransientError(f"S3 read failed: {type(e).__name__}: {e}") from None
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()


class S3Store:
    """``s3://bucket/prefix``; credentials and endpoint come from boto3's usual sources
    (environment, ~/.aws, instance role; AWS_ENDPOINT_URL for MinIO or other S3-compatibles)."""

    def __init__(self, bucket: str, prefix: str = "", client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = client if client is not None else _boto3().client("s3")

    def _key(self, key: str) -> str:
        key = _safe_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, e: Exception, key: str) -> StoreError:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(e, ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = e.response.get("Error", {}).get("Code", "")
            where = f"s3://{self.bucket}/{self._key(key)}"
            if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
                return StoreNotFoundError(f"{where} does not exist")
            if status >= 500 or status == 429 or code in ("SlowDown", "Throttling"):
                return StoreTransientError(f"{where}: {code or status}")
            return StoreError(f"{where}: {code or status}: {e}")
        if isinstance(e, BotoCoreError):
            return StoreTransientError(f"S3 request failed: {e}")
        return StoreTransientError(f"S3 request failed: {type(e).__name__}: {e}")

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            err = self._error(e, key)
            if isinstance(err, StoreNotFoundError):
                return False
            raise err from None

    def get(self, key: str, max_bytes: int) -> bytes | None:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            data = resp["Body"].read(max_bytes + 1)
        except Exception as e:
            err = self._error(e, key)
            if isinstance(err, StoreNotFoundError):
                return None
            raise err from None
        if len(data) > max_bytes:
            where = f"s3://{self.bucket}/{self._key(key)}"
            raise StoreError(f"{where} is over the {max_bytes}-byte limit for this object")
        return data

    def put(self, key: str, data: bytes) -> None:
        try:  # an S3 PUT is atomic: the object appears whole or not at all
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as e:
            raise self._error(e, key) from None

    def open_range(self, key: str, start: int) -> RangeReader:
        try:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-"
            )
        except Exception as e:
            raise self._error(e, key) from None
        content_range = resp.get("ContentRange")  # "bytes 10-99/100"
        size = int(content_range.rsplit("/", 1)[1]) if content_range else int(resp["ContentLength"])
        return _S3Range(resp["Body"], size)


def open_store(uri: str | Path) -> LocalStore | S3Store:
    """A registry location: a folder path, ``file://``, or ``s3://bucket/prefix``."""
    text = str(uri)
    parsed = urlparse(text)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreError(f"{text}: an S3 registry is s3://BUCKET/PREFIX")
        return S3Store(parsed.netloc, parsed.path)
    if parsed.scheme == "file":
        return LocalStore(Path(unquote(parsed.path)))
    if parsed.scheme in ("http", "https"):
        raise StoreError(
            f"{text}: publishing writes to a folder or s3://; serve that folder over HTTP "
            "for devices"
        )
    if parsed.scheme and len(parsed.scheme) > 1:  # 'C:' style drive letters are paths
        raise StoreError(f"{text}: unsupported registry scheme {parsed.scheme!r}")
    return LocalStore(Path(text))


# ---------------------------------------------------------------------------------------------
# Publishing


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
            f"published {m.ref} to {self.uri}: {len(m.tensors)} tensors, {len(m.artefacts)} "
            f"artefacts, {m.total_bytes / 1e6:.1f} MB in {len(m.chunks)} chunks; wrote "
            f"{self.chunks_written} new chunks ({self.bytes_written / 1e6:.1f} MB), reused "
            f"{self.chunks_reused} ({self.bytes_reused / 1e6:.1f} MB); signed by "
            f"{m.signer.name} ({m.signer.key_id})"
        )


ChunkProgress = Callable[[ChunkRef, bool], None]
"""Called per chunk with (chunk, written): written is False when the registry had it."""


def publish_version(
    store: RegistryStore,
    *,
    name: str,
    version: str,
    model: ModelSpec,
    tensors: Sequence[TensorSource],
    key: SigningKey,
    parent: str | None = None,
    training: TrainingInfo | None = None,
    artefacts: Sequence[ArtefactSource] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pack_below: int = DEFAULT_PACK_BELOW,
    known_chunks: Iterable[str] = (),
    on_chunk: ChunkProgress | None = None,
) -> PublishReport:
    """Write the chunks the store lacks, then the signature, then the manifest.

    ``known_chunks`` are hashes the caller knows the store holds (the parent's chunks): they
    are not even asked about, which saves a request per chunk on a slow uplink.
    """
    try:
        check_model_name(name)
        check_version(version)
        if parent is not None:
            check_version(parent)
    except ValueError as e:
        raise PublishError(str(e)) from None
    if store.exists(manifest_key(name, version)):
        raise VersionExistsError(
            f"{name}@{version} already exists in {store.uri}; versions are immutable, "
            "pick a new one"
        )
    for a in artefacts:
        refuse_pickled_file(a.data.path, f"artefact {a.path} ({a.data.path})")
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

    layout = lay_out(tensors, artefacts, chunk_size=chunk_size, pack_below=pack_below,
                     on_chunk=put_chunk)
    manifest = Manifest(
        name=name, version=version, parent=parent, created_at=utc_now(), signer=key.signer,
        model=model, training=training or TrainingInfo(), chunk_size=chunk_size,
        pack_below=pack_below, chunks=layout.chunks, tensors=layout.tensors,
        artefacts=layout.artefacts,
    )
    manifest_bytes = manifest.to_bytes()
    store.put(signature_key(name, version), key.sign_manifest(manifest_bytes))
    store.put(manifest_key(name, version), manifest_bytes)  # last: the version now exists
    return PublishReport(
        manifest, store.uri, counts["written"], counts["bytes_written"], counts["reused"],
        counts["bytes_reused"],
    )


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


@dataclass(frozen=True)
class CheckpointContent:
    """What a registry version takes from an hpc_core checkpoint."""

    path: Path
    model: ModelSpec
    training: TrainingInfo
    tensors: list[TensorSource]


def read_checkpoint(source: Path) -> CheckpointContent:
    """Resolve a run or checkpoint dir and read its weights' layout, spec and metrics."""
    from hpc_core.checkpoint import CheckpointError, read_trainer_state, resolve_checkpoint
    from hpc_core.config import ConfigError, config_from_dict

    try:
        ckpt = resolve_checkpoint(Path(source))
        state = read_trainer_state(ckpt)
    except (CheckpointError, OSError, ValueError) as e:
        raise PublishError(f"cannot read checkpoint {source}: {e}") from None
    try:
        cfg = config_from_dict(state["config"], source=f"{ckpt}/trainer_state.json")
    except (KeyError, ConfigError) as e:
        raise PublishError(f"{ckpt}/trainer_state.json has no valid config: {e}") from None
    m = cfg.model
    if None in (m.num_classes, m.in_channels, m.image_size):
        raise PublishError(
            f"{ckpt}: config.model is not resolved (num_classes, in_channels, image_size are "
            "needed to rebuild the module on a device)"
        )
    spec = ModelSpec(name=m.name, kwargs=m.kwargs, num_classes=m.num_classes,  # type: ignore[arg-type]
                     in_channels=m.in_channels, image_size=m.image_size)  # type: ignore[arg-type]
    metrics = {
        k: float(v) for k, v in (state.get("metrics") or {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    training = TrainingInfo(config_sha256=cfg.digest(), step=state.get("step"),
                            epoch=state.get("epoch"), metrics=metrics)
    tensors = read_safetensors_index(ckpt / "model.safetensors")
    return CheckpointContent(ckpt, spec, training, tensors)


def publish_checkpoint(
    source: Path,
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
    """Publish the weights of any hpc_core checkpoint (or run dir) as ``name@version``."""
    content = read_checkpoint(source)
    if parent is not None and not store.exists(manifest_key(name, parent)):
        raise PublishError(f"parent {name}@{parent} is not in {store.uri}: publish it first")
    return publish_version(
        store, name=name, version=version, parent=parent, model=content.model,
        training=content.training, tensors=content.tensors, artefacts=collect_artefacts(artefacts),
        key=key, chunk_size=chunk_size, pack_below=pack_below,
    )
