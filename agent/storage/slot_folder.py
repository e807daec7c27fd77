"""One slot folder: what a complete version holds, reading it back, building one, and the
marker that says it was committed. :mod:`agent.storage.slots` moves these folders between the
two slots and ``current``.

A folder holds ``model.safetensors``, ``artefacts/``, ``manifest.json``, ``manifest.sig``,
for a device version the upstream release it descends from (``base.manifest.json`` /
``base.manifest.sig``, :mod:`registry.lineage`), ``COMPLETE`` (written last: the folder is
whole) and, once :meth:`agent.storage.slots.ModelSlots.commit` switched to it, ``COMMITTED``
(it passed its gates: a rollback may go to it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from agent.storage.assemble import assemble
from agent.storage.chunk_store import ChunkStore
from agent.storage.nofollow import is_link, read_bytes
from agent.storage.verify import BASE_MANIFEST, BASE_SIGNATURE, MARKER
from registry.atomic import fsync_dir, fsync_file, write_bytes_atomic
from registry.errors import MalformedJsonError, RefusedError, UnsafeStateError
from registry.jsonsafe import loads_strict
from registry.lineage import SignedRelease, device_signed
from registry.manifest import Manifest
from registry.signing import TrustedKey

COMMITTED = "COMMITTED"
"""In a slot that :meth:`agent.storage.slots.ModelSlots.commit` switched to: it passed its
gates. Rollback goes only to a slot that has one."""


@dataclass(frozen=True)
class InstalledSlot:
    slot: str
    path: Path
    manifest: Manifest
    verified_by: str
    """'name (key id)' of the trusted key that verified the version when it was staged."""
    manifest_sha256: str = ""
    """sha256 of the slot's manifest.json: which signed version (every tensor's hash) it holds."""
    device_signed: bool = False
    """Verified by a device-scoped key when staged (a device version, counted by its base)."""
    committed: bool = False
    """The slot carries a ``COMMITTED`` marker for this manifest: it passed its gates and was
    committed, so a rollback may go to it."""

    @property
    def version(self) -> str:
        return self.manifest.version

    def holds(self, version: str | None, manifest_sha256: str | None = None) -> bool:
        """The slot holds ``version`` and, where given, the very manifest of that digest (what
        a job's stage step recorded; a job recorded before the digest gives none): not another
        version, nor the same name staged again by another job or a pull."""
        return self.version == version and manifest_sha256 in (None, self.manifest_sha256)


def _read_marker(path: Path) -> dict[str, object] | None:
    try:
        doc = loads_strict(read_bytes(path / MARKER, 1 << 16), str(path / MARKER))
    except (FileNotFoundError, NotADirectoryError, MalformedJsonError):
        return None
    return doc if isinstance(doc, dict) else None


def read_installed(path: Path, slot: str) -> InstalledSlot | None:
    """A slot with its COMPLETE marker and a parsable manifest, or None."""
    if is_link(path):
        raise UnsafeStateError(f"{path} is a symbolic link where a slot folder belongs: remove it")
    marker = _read_marker(path)
    if marker is None:
        return None
    try:
        data = read_bytes(path / "manifest.json")
        manifest = Manifest.from_bytes(data, source=str(path))
    except (OSError, RefusedError):
        return None
    key = f"{marker.get('key_name', '?')} ({marker.get('key_id', '?')})"
    digest = hashlib.sha256(data).hexdigest()
    committed = _read_committed(path)
    return InstalledSlot(slot, path, manifest, key, digest,
                         device_signed=marker.get("device_signed") is True,
                         committed=committed is not None
                         and committed.get("manifest_sha256") == digest)


def _read_committed(path: Path) -> dict[str, object] | None:
    try:
        doc = loads_strict(read_bytes(path / COMMITTED, 1 << 16), str(path / COMMITTED))
    except (FileNotFoundError, NotADirectoryError, MalformedJsonError):
        return None
    return doc if isinstance(doc, dict) else None


def build_version(
    manifest: Manifest, manifest_bytes: bytes, signature_bytes: bytes, chunks: ChunkStore,
    key: TrustedKey, build: Path, release: SignedRelease | None = None,
) -> None:
    """Assemble a verified version into the new folder ``build``: model, artefacts, manifest,
    signature, the upstream ``release`` it descends from (a device version's lineage,
    :mod:`registry.lineage`) and the COMPLETE marker (written last), all fsynced; removed if
    anything fails. The caller renames it into place (a slot, or a fine-tune's training
    source)."""
    build.mkdir()
    try:
        assemble(manifest, chunks, build)
        files = {"manifest.json": manifest_bytes, "manifest.sig": signature_bytes}
        if release is not None:
            files |= {BASE_MANIFEST: release.manifest_bytes,
                      BASE_SIGNATURE: release.signature_bytes}
        for f, data in files.items():
            (build / f).write_bytes(data)
            fsync_file(build / f)
        marker = {
            "name": manifest.name, "version": manifest.version, "sequence": manifest.sequence,
            "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
            "key_name": key.name, "key_id": key.key_id,
            "device_signed": device_signed(manifest, key),
        }
        (build / MARKER).write_text(json.dumps(marker) + "\n")
        fsync_file(build / MARKER)
        fsync_dir(build)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def mark_committed(installed: InstalledSlot) -> None:
    """Leave the ``COMMITTED`` marker (durably) in a slot that passed its gates."""
    if installed.committed:
        return
    doc = {"version": installed.version, "manifest_sha256": installed.manifest_sha256,
           "committed_at": round(time.time(), 3)}
    write_bytes_atomic(installed.path / COMMITTED, (json.dumps(doc) + "\n").encode())
    fsync_dir(installed.path)
