"""Pull a signed model version from a registry into the device's chunk store.

Order of operations, each a gate for the next:

1. resolve ``name@version`` against the registry (HTTP(S), ``file://``, ``s3://``);
2. fetch ``manifest.json`` + ``manifest.sig`` and verify the signature against the trusted
   keys, then the manifest's schema, names and tiling, then its tensors against the model spec
   - all BEFORE a single chunk is requested;
3. check free disk for the chunks still missing plus the slot they assemble into;
4. fetch only the missing chunks (delta), resuming partial ones with HTTP Range, verifying
   each chunk's sha256 before it enters the store; retries with exponential back-off and full
   jitter, connect/read timeouts, an optional bandwidth cap, a progress callback.

``update()`` then installs into an A/B slot (``agent.slots``) and garbage-collects chunks.

HTTP goes through the standard library's ``http.client``: it gives persistent per-thread
connections (one TCP/TLS handshake per worker, not per chunk) and separate connect and read
timeouts, and it keeps the device free of extra dependencies.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import random
import shutil
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urljoin, urlparse

from pydantic import BaseModel, ConfigDict, Field

from agent.slots import (
    ChunkStore,
    GcReport,
    ModelSlots,
    StateLock,
    SwitchResult,
    gc,
)
from hpc_core.manifest import (
    MAX_MANIFEST_BYTES,
    PICKLE_SUFFIXES,
    ChunkHashError,
    ChunkRef,
    Manifest,
    ManifestError,
    PickleRefusedError,
    TruncatedError,
    check_against_spec,
    check_model_name,
    check_version,
    chunk_key,
    manifest_key,
    signature_key,
)
from hpc_core.publish import (
    RangeReader,
    RegistryStore,
    StoreError,
    StoreNotFoundError,
    StoreTransientError,
    open_store,
)
from hpc_core.signing import MAX_SIGNATURE_BYTES, TrustedKey, verify_manifest

TOKEN_ENV = "EDGETRAIN_REGISTRY_TOKEN"
"""Sent as ``Authorization: Bearer ...`` to HTTP(S) registries when set."""
_READ_BUF = 256 << 10
_MAX_REDIRECTS = 5

Progress = Callable[[int, int], None]
"""progress(done_bytes, total_bytes) for the chunks being downloaded."""


class TransferConfig(BaseModel):
    """Network behaviour of pulls and uploads."""

    model_config = ConfigDict(extra="forbid")

    connect_timeout_s: float = Field(default=10.0, gt=0)
    """TCP (+TLS) connect timeout per attempt."""
    read_timeout_s: float = Field(default=30.0, gt=0)
    """Longest silence tolerated while waiting for response bytes."""
    retries: int = Field(default=8, ge=0)
    """Consecutive failed attempts per request without progress before giving up
    (an attempt that moved bytes resets the count)."""
    backoff_base_s: float = Field(default=0.5, ge=0)
    """First back-off ceiling; doubles per failed attempt (full jitter: uniform in [0, ceiling])."""
    backoff_max_s: float = Field(default=30.0, ge=0)
    """Largest back-off ceiling, and the cap on a server's Retry-After."""
    max_bytes_per_s: int | None = Field(default=None, ge=1024)
    """Bandwidth cap for all connections together (null = no cap)."""
    connections: int = Field(default=4, ge=1, le=32)
    """Parallel chunk transfers; hides round-trip latency on slow links."""
    free_disk_margin_bytes: int = Field(default=64 << 20, ge=0)
    """Space that must stay free after the chunks and the new slot are written."""
    allow_custom_models: bool = False
    """Accept model specs naming a Python factory ('pkg.mod:fn') to import on the device."""


class SyncError(Exception):
    """A pull that could not complete (network, registry, reference)."""


class RefError(SyncError):
    """The model reference cannot be resolved."""


class FetchFailedError(SyncError):
    """A request kept failing through every retry."""


class InsufficientDiskError(SyncError):
    pass


class ManifestMismatchError(ManifestError):
    """The signed manifest is for another name or version than the one requested."""


# ---------------------------------------------------------------------------------------------
# References


@dataclass(frozen=True)
class Ref:
    name: str
    version: str
    registry: str
    """Registry root: http(s)://…, file://…, s3://… or a folder."""

    def __str__(self) -> str:
        return f"{self.name}@{self.version} from {self.registry}"


def parse_ref(ref: str, registry: str | None = None) -> Ref:
    """``name@version`` (needs ``registry``) or a full URL to a version folder / manifest.json:
    ``https://host/reg/name/version[/manifest.json]``, ``file:///srv/reg/name/version``,
    ``s3://bucket/prefix/name/version``."""
    if "://" not in ref:
        name, sep, version = ref.partition("@")
        if not sep:
            raise RefError(f"{ref!r}: give a version, as NAME@VERSION (e.g. digits-cnn@3)")
        if not registry:
            raise RefError(
                f"{ref!r} needs a registry: pass --registry URL or set EDGETRAIN_REGISTRY, or give "
                "a full URL like https://host/registry/NAME/VERSION"
            )
        return _checked(name, version, registry.rstrip("/"))
    parsed = urlparse(ref)
    if parsed.scheme not in ("http", "https", "file", "s3"):
        raise RefError(f"{ref!r}: unsupported scheme {parsed.scheme!r} (http, https, file, s3)")
    path = parsed.path.rstrip("/")
    if path.endswith("/manifest.json"):
        path = path[: -len("/manifest.json")]
    parts = path.split("/")
    if len(parts) < 3 or not parts[-1] or not parts[-2]:
        raise RefError(f"{ref!r}: expected …/REGISTRY/NAME/VERSION[/manifest.json]")
    root = parsed._replace(path="/".join(parts[:-2]), params="", query="", fragment="").geturl()
    if parsed.scheme == "file" and not root.startswith("file:///"):
        root = "file://" + "/".join(parts[:-2])
    return _checked(unquote(parts[-2]), unquote(parts[-1]), root)


def _checked(name: str, version: str, registry: str) -> Ref:
    try:
        check_model_name(name)
        check_version(version)
    except ValueError as e:
        raise RefError(str(e)) from None
    return Ref(name, version, registry)


# ---------------------------------------------------------------------------------------------
# Retries


def backoff_delay(attempt: int, cfg: TransferConfig, retry_after_s: float | None = None) -> float:
    """Full-jitter exponential back-off (AWS's recommendation): a fleet of devices that lost the
    same server does not come back in lock-step. A server's Retry-After is a floor."""
    ceiling = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** max(0, attempt - 1)))
    delay = random.uniform(0, ceiling)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, cfg.backoff_max_s))
    return delay


T = TypeVar("T")


def with_retries(fn: Callable[[], T], cfg: TransferConfig, what: str) -> T:
    """Run a whole request, retrying StoreTransientError with back-off."""
    attempt = 0
    while True:
        try:
            return fn()
        except StoreTransientError as e:
            attempt += 1
            if attempt > cfg.retries:
                raise FetchFailedError(f"{what}: gave up after {attempt} attempts: {e}") from e
            time.sleep(backoff_delay(attempt, cfg, e.retry_after_s))


class RateLimiter:
    """A token bucket shared by every connection; allows a 100 ms burst."""

    def __init__(self, bytes_per_s: int) -> None:
        self.rate = float(bytes_per_s)
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now - 0.1) + nbytes / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)


# ---------------------------------------------------------------------------------------------
# HTTP(S) registry


class _HttpRange:
    """A response body being streamed; keeps the connection for reuse only if fully read."""

    def __init__(self, store: HttpStore, conn: http.client.HTTPConnection | None,
                 resp: http.client.HTTPResponse, size: int, remaining: int, url: str) -> None:
        self._store, self._conn, self._resp = store, conn, resp
        self.size, self.remaining, self.url = size, remaining, url

    def readinto(self, buf: memoryview) -> int:
        if self.remaining == 0:
            return 0
        view = buf[: self.remaining]
        try:
            n = self._resp.readinto(view)
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise StoreTransientError(f"{self.url}: read failed: {type(e).__name__}: {e}") from None
        if n == 0:
            self._drop()
            raise StoreTransientError(
                f"{self.url}: connection closed with {self.remaining} bytes of the body unread"
            )
        self.remaining -= n
        return n

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._store._forget(self._conn)
            self._conn = None

    def close(self) -> None:
        if self.remaining:
            self._drop()  # unread body bytes would corrupt the next response on this connection
        self._resp.close()


class HttpStore:
    """A registry served over HTTP(S): GET (with Range) to read, HEAD to probe, PUT to write
    (for uploads to servers that accept them, e.g. nginx dav or pre-authorized object URLs)."""

    def __init__(self, base_url: str, cfg: TransferConfig | None = None) -> None:
        self.cfg = cfg or TransferConfig()
        parsed = urlparse(base_url.rstrip("/"))
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise RefError(f"{base_url!r} is not an http(s) URL")
        self.uri = base_url.rstrip("/")
        self._origin = (parsed.scheme, parsed.hostname, parsed.port)
        self._base_path = parsed.path
        token = os.environ.get(TOKEN_ENV)
        self._headers = {"Accept-Encoding": "identity", "User-Agent": "edgetrain-agent"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._local = threading.local()

    # -- connections

    def _connect(self, scheme: str, host: str, port: int | None) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(
                host, port, timeout=self.cfg.connect_timeout_s, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.cfg.connect_timeout_s)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise StoreTransientError(f"cannot connect to {host}:{port}: {e}") from None
        assert conn.sock is not None
        conn.sock.settimeout(self.cfg.read_timeout_s)  # connect timeout above, read timeout now
        return conn

    def _pooled(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = self._connect(*self._origin)
        self._local.conn = conn
        return conn, False

    def _forget(self, conn: http.client.HTTPConnection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- requests

    def url(self, key: str) -> str:
        scheme, host, port = self._origin
        netloc = host if port is None else f"{host}:{port}"
        return f"{scheme}://{netloc}{self._base_path}/{quote(key)}"

    def _request(self, method: str, key: str, headers: dict[str, str] | None = None,
                 body: bytes | None = None) -> tuple[http.client.HTTPResponse, Any, str]:
        """Send a request, following redirects; returns (response, pooled conn or None, url)."""
        url = self.url(key)
        hdrs = {**self._headers, **(headers or {})}
        for _ in range(_MAX_REDIRECTS + 1):
            target = urlparse(url)
            pooled = (target.scheme, target.hostname, target.port) == self._origin
            resp, conn = self._send(method, target, hdrs, body, pooled)
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                location = urljoin(url, resp.getheader("Location", ""))
                resp.read()
                if urlparse(location).scheme not in ("http", "https") or (
                    target.scheme == "https" and urlparse(location).scheme == "http"
                ):
                    raise StoreError(f"{url}: refusing redirect to {location}")
                new = urlparse(location)
                if (new.scheme, new.hostname, new.port) != (target.scheme, target.hostname,
                                                            target.port):
                    hdrs.pop("Authorization", None)  # never hand the token to another origin
                url = location
                continue
            return resp, (conn if pooled else None), url
        raise StoreError(f"{self.url(key)}: more than {_MAX_REDIRECTS} redirects")

    def _send(self, method: str, target: Any, headers: dict[str, str], body: bytes | None,
              pooled: bool) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        path = target.path + (f"?{target.query}" if target.query else "")
        for fresh_retry in (False, True):
            if pooled:
                conn, reused = self._pooled()
            else:
                conn, reused = self._connect(target.scheme, target.hostname, target.port), False
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                if not pooled:
                    # A one-off connection (a redirect target): the socket stays open until
                    # the response is read or closed, then goes with it.
                    conn.close()
                return resp, conn
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if pooled:
                    self._forget(conn)
                # A kept-alive connection the server already closed fails on first use: that is
                # not a failed attempt, so reconnect once without spending a retry.
                if reused and not fresh_retry and isinstance(
                    e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                ):
                    continue
                raise StoreTransientError(
                    f"{method} {target.geturl()}: {type(e).__name__}: {e}"
                ) from None
        raise AssertionError("unreachable")

    def _fail(self, resp: http.client.HTTPResponse, conn: Any, url: str) -> StoreError:
        with contextlib.suppress(OSError, http.client.HTTPException):
            resp.read(64 << 10)
        if conn is not None and not resp.isclosed():
            conn.close()
            self._forget(conn)
        status = resp.status
        if status in (404, 410):
            return StoreNotFoundError(f"{url}: HTTP {status}")
        if status in (408, 425, 429) or status >= 500:
            retry_after = resp.getheader("Retry-After")
            seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
            return StoreTransientError(f"{url}: HTTP {status} {resp.reason}", seconds)
        if status in (401, 403):
            return StoreError(f"{url}: HTTP {status}: access denied (set {TOKEN_ENV}?)")
        return StoreError(f"{url}: HTTP {status} {resp.reason}")

    # -- RegistryStore protocol

    def exists(self, key: str) -> bool:
        resp, conn, url = self._request("HEAD", key)
        resp.read()
        if resp.status == 200:
            return True
        err = self._fail(resp, conn, url)
        if isinstance(err, StoreNotFoundError):
            return False
        raise err

    def get(self, key: str, max_bytes: int) -> bytes | None:
        resp, conn, url = self._request("GET", key)
        if resp.status != 200:
            err = self._fail(resp, conn, url)
            if isinstance(err, StoreNotFoundError):
                return None
            raise err
        length = resp.getheader("Content-Length")
        if length is not None and int(length) > max_bytes:
            resp.close()
            if conn is not None:
                conn.close()
                self._forget(conn)
            raise StoreError(f"{url}: {length} bytes, over the {max_bytes}-byte limit")
        try:
            data = resp.read(max_bytes + 1)
        except (OSError, http.client.HTTPException) as e:
            if conn is not None:
                conn.close()
                self._forget(conn)
            raise StoreTransientError(f"{url}: {type(e).__name__}: {e}") from None
        if len(data) > max_bytes:
            raise StoreError(f"{url}: over the {max_bytes}-byte limit")
        if length is not None and len(data) != int(length):
            # read(amt) returns short at a premature close instead of raising: check ourselves.
            if conn is not None:
                conn.close()
                self._forget(conn)
            raise StoreTransientError(
                f"{url}: connection closed after {len(data)} of {length} bytes"
            )
        return data

    def put(self, key: str, data: bytes) -> None:
        resp, conn, url = self._request(
            "PUT", key, {"Content-Type": "application/octet-stream"}, body=data
        )
        resp.read()
        if resp.status not in (200, 201, 204):
            raise self._fail(resp, conn, url)

    def open_range(self, key: str, start: int) -> RangeReader:
        resp, conn, url = self._request("GET", key, {"Range": f"bytes={start}-"})
        if resp.status == 206:
            # "bytes START-END/TOTAL": the resume point must be exactly where we asked.
            content_range = resp.getheader("Content-Range", "")
            try:
                unit_first, total = content_range.split("/")
                first = int(unit_first.split()[1].split("-")[0])
                size = int(total)
            except (ValueError, IndexError):
                resp.close()
                raise StoreError(f"{url}: bad Content-Range {content_range!r}") from None
            if first != start:
                resp.close()
                raise StoreError(f"{url}: asked for byte {start}, server sent {first}")
            return _HttpRange(self, conn, resp, size, size - start, url)
        if resp.status == 200:
            size = int(resp.getheader("Content-Length", "-1"))
            if size < 0:
                resp.close()
                raise StoreError(f"{url}: no Content-Length")
            reader = _HttpRange(self, conn, resp, size, size, url)
            _skip(reader, min(start, size))  # server ignored Range: drop what we already hold
            return reader
        if resp.status == 416:
            resp.read()
            raise TruncatedError(f"{url}: the registry's object is shorter than byte {start}")
        raise self._fail(resp, conn, url)


def _skip(reader: RangeReader, nbytes: int) -> None:
    buf = memoryview(bytearray(min(nbytes, _READ_BUF) or 1))
    while nbytes:
        nbytes -= reader.readinto(buf[: min(nbytes, len(buf))])


def open_registry(uri: str, cfg: TransferConfig | None = None) -> RegistryStore:
    """http(s) -> HttpStore; folder, file:// and s3:// -> hpc_core.publish stores."""
    if urlparse(uri).scheme in ("http", "https"):
        return HttpStore(uri, cfg)
    try:
        return open_store(uri)
    except StoreError as e:
        raise RefError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Chunk download


class _Cancelled(Exception):
    pass


class _Downloads:
    """Fetch chunks into the store with resume, verification, retries; several at a time."""

    def __init__(self, source: RegistryStore, store: ChunkStore, cfg: TransferConfig,
                 total: int, progress: Progress | None) -> None:
        self.source, self.store, self.cfg = source, store, cfg
        self.limiter = RateLimiter(cfg.max_bytes_per_s) if cfg.max_bytes_per_s else None
        self.stop = threading.Event()
        self.total, self.done = total, 0
        self.downloaded = 0
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
        self.store.partial_dir.mkdir(parents=True, exist_ok=True)
        workers = min(self.cfg.connections, len(chunks))
        with ThreadPoolExecutor(workers, thread_name_prefix="chunk") as pool:
            futures = [pool.submit(self.fetch, c) for c in chunks]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                self.stop.set()
                wait(futures)
                errors = [f.exception() for f in futures if f.exception() is not None]
                first = next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])
                raise first  # type: ignore[misc]
        if isinstance(self.source, HttpStore):
            self.source.close()

    def fetch(self, ref: ChunkRef) -> None:
        part = _Partial.resume(self.store.partial(ref.sha256), ref.size)
        attempt = bad_hashes = 0
        while True:
            if self.stop.is_set():
                raise _Cancelled
            before = part.have
            try:
                if part.have < ref.size:
                    self._fetch_range(ref, part)
            except StoreTransientError as e:
                attempt = 0 if part.have > before else attempt + 1  # progress resets the count
                if attempt > self.cfg.retries:
                    raise FetchFailedError(
                        f"chunk {ref.sha256[:16]}: gave up after {attempt} attempts without "
                        f"progress ({part.have} of {ref.size} bytes): {e}"
                    ) from e
                time.sleep(backoff_delay(attempt, self.cfg, e.retry_after_s))
                continue
            digest = part.hasher.hexdigest()
            if digest == ref.sha256:
                self.store.commit(part.path, ref.sha256)
                return
            # A corrupt partial (power cut) or bad bytes from a proxy: start over once, then
            # believe it is the registry's copy that is bad.
            bad_hashes += 1
            with self._lock:
                self.done -= part.have
            part.restart()
            if bad_hashes > 1:
                raise ChunkHashError(
                    f"chunk {ref.sha256[:16]} from {self.source.uri}: the bytes served hash to "
                    f"{digest[:16]}…, not the signed {ref.sha256[:16]}…; the registry's copy "
                    "is corrupt: republish the version", ref.sha256,
                )

    def _fetch_range(self, ref: ChunkRef, part: _Partial) -> None:
        reader = self.source.open_range(chunk_key(ref.sha256), part.have)
        try:
            if reader.size != ref.size:
                raise TruncatedError(
                    f"chunk {ref.sha256[:16]}: the registry holds {reader.size} bytes, the signed "
                    f"manifest says {ref.size}: the registry copy is truncated or wrong"
                )
            bufsize = _READ_BUF
            if self.limiter is not None:  # small reads keep a capped link smooth
                bufsize = max(16 << 10, min(bufsize, int(self.limiter.rate) // 20))
            buf = memoryview(bytearray(bufsize))
            with open(part.path, "ab") as out:
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


@dataclass
class _Partial:
    """A chunk being downloaded: the .part file, how much of it is written, its running hash.
    Every byte written is hashed in the same step, so a retry resumes exactly at ``have``."""

    path: Path
    hasher: Any
    have: int

    @classmethod
    def resume(cls, path: Path, size: int) -> _Partial:
        """Pick up what an earlier attempt (or a killed process) left in the partial file."""
        hasher = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                data = f.read(size + 1)
        except FileNotFoundError:
            return cls(path, hasher, 0)
        if len(data) > size:
            path.unlink()
            return cls(path, hasher, 0)
        hasher.update(data)
        return cls(path, hasher, len(data))

    def restart(self) -> None:
        self.path.unlink(missing_ok=True)
        self.hasher, self.have = hashlib.sha256(), 0


# ---------------------------------------------------------------------------------------------
# Pull


@dataclass(frozen=True)
class PullResult:
    ref: Ref
    manifest: Manifest
    manifest_bytes: bytes
    signature_bytes: bytes
    signer: TrustedKey
    chunks_fetched: int
    chunks_reused: int
    bytes_fetched: int
    """Chunk bytes moved over the network in this pull (resumed bytes are not counted twice)."""


def fetch_verified_manifest(
    source: RegistryStore, ref: Ref, trusted: dict[str, TrustedKey], cfg: TransferConfig
) -> tuple[Manifest, bytes, bytes, TrustedKey]:
    """Manifest and signature, checked against the trusted keys, names and the model spec."""
    mkey, skey = manifest_key(ref.name, ref.version), signature_key(ref.name, ref.version)
    try:
        manifest_bytes = with_retries(lambda: source.get(mkey, MAX_MANIFEST_BYTES), cfg, mkey)
        signature_bytes = with_retries(lambda: source.get(skey, MAX_SIGNATURE_BYTES), cfg, skey)
    except StoreError as e:
        raise FetchFailedError(f"{ref}: {e}") from e
    if manifest_bytes is None:
        raise RefError(f"{ref}: no such version (no {mkey})")
    label = f"{ref.name}@{ref.version}"
    signer = verify_manifest(manifest_bytes, signature_bytes, trusted, source=label)
    manifest = Manifest.from_bytes(manifest_bytes, source=label)
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
    check_against_spec(manifest, allow_custom=cfg.allow_custom_models)
    return manifest, manifest_bytes, signature_bytes or b"", signer


def _check_disk(
    state_dir: Path, manifest: Manifest, missing_bytes: int, cfg: TransferConfig
) -> None:
    slots = ModelSlots(state_dir, manifest.name)
    # The standby slot is discarded before the new one is written: its space counts as free.
    free = shutil.disk_usage(state_dir).free + slots.slot_bytes(slots.standby_slot_name())
    slot_bytes = manifest.total_bytes + 64 * len(manifest.tensors) + (1 << 16)
    need = missing_bytes + slot_bytes + cfg.free_disk_margin_bytes
    if need > free:
        mb = 1 << 20
        raise InsufficientDiskError(
            f"not enough disk in {state_dir} for {manifest.ref}: needs {need / mb:.0f} MiB "
            f"({missing_bytes / mb:.0f} to download + {slot_bytes / mb:.0f} to install + "
            f"{cfg.free_disk_margin_bytes / mb:.0f} margin), {free / mb:.0f} MiB available. Free "
            "space (e.g. `agentctl gc`) or lower free_disk_margin_bytes"
        )


def pull(
    ref: Ref,
    *,
    state_dir: Path,
    trusted: dict[str, TrustedKey],
    cfg: TransferConfig | None = None,
    progress: Progress | None = None,
) -> PullResult:
    """Verify ``ref``'s manifest, then fetch the chunks the local store lacks."""
    cfg = cfg or TransferConfig()
    state_dir = Path(state_dir)
    source = open_registry(ref.registry, cfg)
    with StateLock(state_dir):
        manifest, manifest_bytes, signature_bytes, signer = fetch_verified_manifest(
            source, ref, trusted, cfg
        )
        store = ChunkStore(state_dir)
        missing = store.missing(manifest.chunks)
        partial = store.partial_bytes(missing)
        missing_bytes = sum(c.size for c in missing)
        _check_disk(state_dir, manifest, missing_bytes - partial, cfg)
        downloads = _Downloads(source, store, cfg, missing_bytes, progress)
        downloads.done = partial
        try:
            downloads.run(missing)
        except StoreError as e:
            raise FetchFailedError(f"{ref}: {e}") from e
    unique = len({c.sha256 for c in manifest.chunks})
    return PullResult(ref, manifest, manifest_bytes, signature_bytes, signer, len(missing),
                      unique - len(missing), downloads.downloaded)


@dataclass(frozen=True)
class UpdateResult:
    pulled: PullResult
    switch: SwitchResult
    gc: GcReport


def update(
    ref: Ref,
    *,
    state_dir: Path,
    trusted: dict[str, TrustedKey],
    cfg: TransferConfig | None = None,
    progress: Progress | None = None,
) -> UpdateResult:
    """Pull, install into the standby slot, switch ``current``, collect unreferenced chunks."""
    with StateLock(state_dir):
        pulled = pull(ref, state_dir=state_dir, trusted=trusted, cfg=cfg, progress=progress)
        slots = ModelSlots(state_dir, ref.name)
        store = ChunkStore(state_dir)
        try:
            switch = slots.install(pulled.manifest, pulled.manifest_bytes, pulled.signature_bytes,
                                   store)
        except ChunkHashError:
            # A local chunk rotted on disk since it was verified; it was dropped: fetch it again.
            pulled = pull(ref, state_dir=state_dir, trusted=trusted, cfg=cfg, progress=progress)
            switch = slots.install(pulled.manifest, pulled.manifest_bytes, pulled.signature_bytes,
                                   store)
        report = gc(state_dir)
    return UpdateResult(pulled, switch, report)
