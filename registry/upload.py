"""Upload back: publish the device's fine-tuned model as a new version (device -> cloud).

The new version names the installed one it was fine-tuned from as its parent and is signed
with the device's own key, so the cloud knows which device produced it (its ``signer``) and
can trust it or not, key by key. It is cut with the parent's chunk size and packing rule, so
tensors the fine-tune left alone (usually all but the trainable ones) give the chunks the
registry already holds and are not sent again; only changed tensors, the metrics and the
export artefacts travel.

Resumable at chunk granularity: every chunk is probed (HEAD) before it is sent, and the
manifest goes last, so re-running an interrupted upload sends only what is still missing and
at most one partly sent chunk is repeated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from registry.credentials import RegistryCredential
from registry.errors import PublishError
from registry.manifest import ChunkRef, Manifest
from registry.names import MAX_VERSION_CHARS, check_version
from registry.publish import PublishReport, VersionContent, collect_artefacts, publish_version
from registry.signing import SigningKey
from registry.stores import RangeReader, RegistryStore, open_store
from registry.transfer import Deadline, TransferConfig, with_retries


class _RetryingStore:
    """Every registry request of an upload, retried with back-off on transient failures."""

    def __init__(self, store: RegistryStore, cfg: TransferConfig) -> None:
        self._store, self._cfg = store, cfg
        self.uri = store.uri

    def exists(self, key: str, deadline: Deadline | None = None) -> bool:
        return with_retries(lambda d: self._store.exists(key, d), self._cfg, f"HEAD {key}")

    def get(self, key: str, max_bytes: int, deadline: Deadline | None = None) -> bytes | None:
        return with_retries(lambda d: self._store.get(key, max_bytes, d), self._cfg,
                            f"GET {key}")

    def put(self, key: str, data: bytes, deadline: Deadline | None = None) -> None:
        with_retries(lambda d: self._store.put(key, data, d), self._cfg, f"PUT {key}")

    def open_range(self, key: str, start: int, deadline: Deadline | None = None) -> RangeReader:
        return self._store.open_range(key, start, deadline)

    def close(self) -> None:
        self._store.close()


def default_version(base: str, device: str, sequence: int | None = None) -> str:
    """``{base}+{device}.{UTC time}[.{sequence}]``: the upstream release the lineage starts
    from, the device, when, and (staging on the device) the sequence it signs. A fine-tune of
    a fine-tune names the same base, so names do not grow with the chain, and the device's
    own sequence keeps each unique on it. Cut to 64 characters on the base's side only:
    ``+DEVICE.`` is what the device key's scope matches. A label only: the order of versions
    is their signed sequence, never this string; the manifest keeps the lineage."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    tail = f"+{device}.{stamp}" + (f".{sequence}" if sequence is not None else "")
    room = MAX_VERSION_CHARS - len(tail)
    if room < 1:
        raise PublishError(f"device name {device!r} leaves no room for a version name of at "
                           f"most {MAX_VERSION_CHARS} characters: give the version explicitly")
    return check_version(base[:room] + tail)


def merge_metrics(content: VersionContent, metrics: dict[str, float] | None) -> VersionContent:
    merged = dict(content.training.metrics)
    for k, v in (metrics or {}).items():
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise PublishError(f"metric {k} is {v!r}: only finite numbers can be published")
        merged[k] = float(v)
    training = content.training.model_copy(update={"metrics": merged})
    return VersionContent(content.path, content.model, training, content.tensors,
                          content.layout)


def upload(
    content: VersionContent,
    *,
    parent: Manifest,
    target: str,
    key: SigningKey,
    version: str | None = None,
    artefacts: Sequence[Path] = (),
    metrics: dict[str, float] | None = None,
    cfg: TransferConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
    credential: RegistryCredential | None = None,
) -> PublishReport:
    """Publish fine-tuned ``content`` to ``target`` as a child of the installed ``parent``.

    ``progress(done, total)`` counts the version's bytes as chunks are checked or sent.
    ``credential``: this device's registry token, sent only if ``target`` is its registry.
    """
    cfg = cfg or TransferConfig()
    content = merge_metrics(content, metrics)
    version = version or default_version(parent.base_release.version, key.name)
    arts = collect_artefacts(artefacts)
    total = sum(t.data.nbytes for t in content.tensors) + sum(a.data.nbytes for a in arts)
    done = 0

    def on_chunk(ref: ChunkRef, written: bool) -> None:
        nonlocal done
        done += ref.size
        if progress is not None:
            progress(done, total)

    store = _RetryingStore(open_store(target, cfg, credential), cfg)
    return publish_version(
        store, name=parent.name, version=version, parent=parent.version,
        parent_seq=parent.sequence, base=parent.base_release, model=content.model,
        training=content.training,
        tensors=content.tensors, artefacts=arts, key=key, spec_layout=content.layout,
        # The parent's cutting rule: unchanged tensors must give the very same chunks.
        chunk_size=parent.chunk_size, pack_below=parent.pack_below, on_chunk=on_chunk,
    )
