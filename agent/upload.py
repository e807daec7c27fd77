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

from agent.slots import InstalledSlot, ModelSlots, NoActiveModelError, SlotError
from agent.sync import TransferConfig, open_registry, with_retries
from hpc_core.manifest import ChunkRef, check_version
from hpc_core.publish import (
    PublishError,
    PublishReport,
    RangeReader,
    RegistryStore,
    collect_artefacts,
    publish_version,
    read_checkpoint,
)
from hpc_core.signing import SigningKey


class _RetryingStore:
    """Every registry request of an upload, retried with back-off on transient failures."""

    def __init__(self, store: RegistryStore, cfg: TransferConfig) -> None:
        self._store, self._cfg = store, cfg
        self.uri = store.uri

    def exists(self, key: str) -> bool:
        return with_retries(lambda: self._store.exists(key), self._cfg, f"HEAD {key}")

    def get(self, key: str, max_bytes: int) -> bytes | None:
        return with_retries(lambda: self._store.get(key, max_bytes), self._cfg, f"GET {key}")

    def put(self, key: str, data: bytes) -> None:
        with_retries(lambda: self._store.put(key, data), self._cfg, f"PUT {key}")

    def open_range(self, key: str, start: int) -> RangeReader:
        return self._store.open_range(key, start)


def find_parent(state_dir: Path, name: str, version: str | None) -> InstalledSlot:
    """The installed version a fine-tune started from: the active one unless named."""
    slots = ModelSlots(state_dir, name)
    active = slots.active()
    if active is None:
        raise NoActiveModelError(f"no model {name!r} is installed in {state_dir}: pull one first")
    if version is None or active.version == version:
        return active
    standby = slots.standby()
    if standby is not None and standby.version == version:
        return standby
    raise SlotError(f"{name}@{version} is not installed in {state_dir} (active: {active.version})")


def default_version(parent: str, device: str) -> str:
    """``{parent}+{device}.{UTC time}``: unique per device and upload, sorts by time."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return check_version(f"{parent}+{device}.{stamp}"[:64])


def upload(
    checkpoint: Path,
    *,
    state_dir: Path,
    name: str,
    target: str,
    key: SigningKey,
    version: str | None = None,
    parent: str | None = None,
    artefacts: Sequence[Path] = (),
    metrics: dict[str, float] | None = None,
    cfg: TransferConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PublishReport:
    """Publish the fine-tuned ``checkpoint`` (an hpc_core checkpoint or run dir) to ``target``.

    ``progress(done, total)`` counts the version's bytes as chunks are checked or sent.
    """
    cfg = cfg or TransferConfig()
    base = find_parent(state_dir, name, parent)
    content = read_checkpoint(checkpoint)
    merged = dict(content.training.metrics)
    for k, v in (metrics or {}).items():
        if not math.isfinite(v):
            raise PublishError(f"metric {k} is {v}: only finite numbers can be published")
        merged[k] = float(v)
    training = content.training.model_copy(update={"metrics": merged})
    version = version or default_version(base.version, key.name)
    arts = collect_artefacts(artefacts)
    total = sum(t.data.nbytes for t in content.tensors) + sum(a.data.nbytes for a in arts)
    done = 0

    def on_chunk(ref: ChunkRef, written: bool) -> None:
        nonlocal done
        done += ref.size
        if progress is not None:
            progress(done, total)

    store = _RetryingStore(open_registry(target, cfg), cfg)
    return publish_version(
        store, name=name, version=version, parent=base.version, model=content.model,
        training=training, tensors=content.tensors, artefacts=arts, key=key,
        # The parent's cutting rule: unchanged tensors must give the very same chunks.
        chunk_size=base.manifest.chunk_size, pack_below=base.manifest.pack_below,
        on_chunk=on_chunk,
    )
