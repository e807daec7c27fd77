"""Bring a registry version onto the device: the steps of ``agentctl pull``, and staging a
version the device produced itself.

:func:`pull` verifies the manifest (signature, key scope, name, and for a version a
device-scoped key signed, the upstream release it names as its base, fetched from the same
registry: :mod:`registry.lineage`), the sequence against the highest installed and the tensors
against the model spec (torch-free; a custom factory in a child process, so the caller never
imports torch) - all before a chunk moves - then checks free disk and fetches the missing
chunks, under the state lock. :func:`update` adds install
(stage + commit) and garbage collection. :func:`fetch_training_source` brings the version a
fine-tune starts from into the job's folder, never into a slot. :func:`stage_local` cuts a
locally fine-tuned checkpoint into the chunk store, signs it with the device key and stages
it, so the device job can run its gates on it before ``ModelSlots.commit``.
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.storage.anti_rollback import refuse_downgrade
from agent.storage.chunk_store import ChunkStore
from agent.storage.gc import GcReport, gc
from agent.storage.lock import StateLock
from agent.storage.slots import (
    InstalledSlot,
    ModelSlots,
    SwitchResult,
    build_version,
    read_installed,
)
from agent.storage.spec_check import check_model_spec
from agent.storage.verify import slot_release
from registry.chunks import ArtefactSource
from registry.errors import ChunkHashError, InsufficientDiskError, LineageError, RefError
from registry.lineage import SignedRelease, check_descends, check_release, device_signed
from registry.manifest import ChunkRef, Manifest
from registry.publish import VersionContent, sign_version
from registry.pull import Progress, VerifiedManifest, download, fetch_verified_manifest
from registry.refs import Ref
from registry.signing import SigningKey, TrustedKey, verify_signed_manifest
from registry.stores import RegistryStore, open_store
from registry.transfer import TransferConfig

log = logging.getLogger("agent.storage")


@dataclass(frozen=True)
class PullResult:
    ref: Ref
    verified: VerifiedManifest
    chunks_fetched: int
    chunks_reused: int
    bytes_fetched: int
    """Chunk bytes moved over the network in this pull (resumed bytes are not counted twice)."""
    release: SignedRelease | None = None
    """A device version's upstream release (its ``base``), verified; None for an upstream
    release (:func:`fetch_release`)."""

    @property
    def manifest(self) -> Manifest:
        return self.verified.manifest

    @property
    def key(self) -> TrustedKey:
        """The trusted key that verified the version."""
        return self.verified.key


@dataclass(frozen=True)
class UpdateResult:
    pulled: PullResult
    switch: SwitchResult
    gc: GcReport


def check_disk(state_dir: Path, manifest: Manifest, missing_bytes: int,
               cfg: TransferConfig) -> None:
    # The standby slot (the rollback target) stays until the new version is complete beside
    # it (ModelSlots.stage): its bytes are not counted as free, into a slot or not.
    free = shutil.disk_usage(state_dir).free
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
    training_source: bool = False,
) -> PullResult:
    """Verify ``ref``'s manifest, then fetch the chunks the local store lacks.

    ``training_source``: the version is only trained from (:func:`fetch_training_source`),
    never installed, so a sequence below the highest installed is logged, not refused. What
    can become active stays guarded: ``ModelSlots.stage`` and ``commit`` check the sequence
    themselves (:func:`agent.storage.anti_rollback.refuse_downgrade`)."""
    cfg = cfg or TransferConfig()
    state_dir = Path(state_dir)
    source = open_store(ref.registry, cfg)
    with StateLock(state_dir):
        verified = fetch_verified_manifest(source, ref, trusted, cfg)
        manifest = verified.manifest
        release = fetch_release(source, ref, verified, trusted, cfg)
        slots = ModelSlots(state_dir, ref.name)
        if not training_source:
            refuse_downgrade(manifest, slots.installed_record(), model=slots.name,
                             device_signed=device_signed(manifest, verified.key),
                             allow_downgrade=cfg.allow_downgrade)
        elif manifest.sequence < slots.highest_sequence():
            log.info("fetching %s below the highest installed sequence %d as a training "
                     "source only: it is never installed", manifest.ref,
                     slots.highest_sequence(), extra={"fields": {
                         "event": "training_source", "model": ref.name,
                         "version": manifest.version, "sequence": manifest.sequence,
                         "highest_sequence": slots.highest_sequence()}})
        # Torch-free (a custom factory's check runs in a torch child): see spec_check.
        check_model_spec(manifest, verified.manifest_bytes, allow_custom=cfg.allow_custom_models)
        store = ChunkStore(state_dir)
        missing = store.missing(manifest.chunks)
        missing_bytes = sum(c.size for c in missing)
        check_disk(state_dir, manifest, missing_bytes - store.partial_bytes(missing), cfg)
        fetched = download(source, store, missing, cfg, total=missing_bytes, progress=progress)
    unique = len({c.sha256 for c in manifest.chunks})
    return PullResult(ref, verified, len(missing), unique - len(missing), fetched, release)


def fetch_release(source: RegistryStore, ref: Ref, verified: VerifiedManifest,
                  trusted: dict[str, TrustedKey], cfg: TransferConfig) -> SignedRelease | None:
    """For a version a device-scoped key signed: the upstream release its ``base`` names,
    fetched from the same registry and verified as one, then checked against the version
    (:func:`registry.lineage.check_descends`); LineageError when it names none, the registry
    lacks it, or it is not that upstream release. None for an upstream-signed version."""
    manifest, key = verified.manifest, verified.key
    label = f"{ref.name}@{ref.version}"
    if not device_signed(manifest, key) or manifest.base is None:
        return check_descends(manifest, key, None, label)  # None, or the refusal
    base_ref = Ref(manifest.name, manifest.base.version, ref.registry)
    try:
        got = fetch_verified_manifest(source, base_ref, trusted, cfg)
    except RefError:
        raise LineageError(
            f"{label}: signed by device-scoped key {key.name}, it names the base "
            f"{manifest.name}@{manifest.base.version}, which {ref.registry} does not hold: a "
            "device version is installed only with the upstream release it descends from"
        ) from None
    check_release(got.manifest, got.key, f"{base_ref.name}@{base_ref.version} (the base of "
                  f"{label})")
    release = SignedRelease(got.manifest, got.manifest_bytes, got.signature_bytes, got.key)
    return check_descends(manifest, key, release, label)


def update(
    ref: Ref,
    *,
    state_dir: Path,
    trusted: dict[str, TrustedKey],
    cfg: TransferConfig | None = None,
    progress: Progress | None = None,
) -> UpdateResult:
    """Pull, install into the standby slot, switch ``current``, collect unreferenced chunks."""
    cfg = cfg or TransferConfig()
    with StateLock(state_dir):
        pulled = pull(ref, state_dir=state_dir, trusted=trusted, cfg=cfg, progress=progress)
        slots = ModelSlots(state_dir, ref.name)

        def install(p: PullResult) -> SwitchResult:
            v = p.verified
            return slots.install(v.manifest, v.manifest_bytes, v.signature_bytes,
                                 ChunkStore(state_dir), v.key, release=p.release,
                                 allow_downgrade=cfg.allow_downgrade)

        try:
            switch = install(pulled)
        except ChunkHashError:
            # A local chunk rotted on disk since it was verified; it was dropped: fetch it again.
            pulled = pull(ref, state_dir=state_dir, trusted=trusted, cfg=cfg, progress=progress)
            switch = install(pulled)
        report = gc(state_dir)
    return UpdateResult(pulled, switch, report)


def fetch_training_source(
    ref: Ref,
    dest: Path,
    *,
    state_dir: Path,
    trusted: dict[str, TrustedKey],
    cfg: TransferConfig | None = None,
    progress: Progress | None = None,
) -> tuple[PullResult, InstalledSlot]:
    """Fetch a version a fine-tune starts from into ``dest`` (the job's folder), outside the
    slots: verified like any pull (signature, key scope, name, model spec, every chunk,
    tensor and artefact hash) but never staged, so it can never be committed and the
    anti-rollback rule (which guards what becomes active) does not apply to it. ``dest`` is
    replaced whole, by one rename of a complete folder.
    """
    state_dir, dest = Path(state_dir), Path(dest)

    def fetch() -> PullResult:
        return pull(ref, state_dir=state_dir, trusted=trusted, cfg=cfg, progress=progress,
                    training_source=True)

    def build(p: PullResult) -> Path:
        v, folder = p.verified, dest.parent / f".new-{dest.name}-{secrets.token_hex(4)}"
        build_version(v.manifest, v.manifest_bytes, v.signature_bytes, ChunkStore(state_dir),
                      v.key, folder, p.release)
        return folder

    with StateLock(state_dir):
        # Under one lock hold: a gc cannot drop the chunks between download and assembly.
        pulled = fetch()
        try:
            folder = build(pulled)
        except ChunkHashError:
            # A local chunk rotted on disk since it was verified; it was dropped: fetch again.
            pulled = fetch()
            folder = build(pulled)
        if dest.exists():
            shutil.rmtree(dest)
        folder.rename(dest)
    got = read_installed(dest, "upstream")
    assert got is not None  # build_version writes the marker last
    return pulled, got


def next_local_sequence(slots: ModelSlots, parent: InstalledSlot) -> int:
    """The sequence a version the device makes from ``parent`` signs: one above both."""
    return max(parent.manifest.sequence, slots.highest_sequence()) + 1


def stage_local(
    content: VersionContent,
    *,
    state_dir: Path,
    parent: InstalledSlot,
    version: str,
    key: SigningKey,
    trusted: dict[str, TrustedKey],
    artefacts: Sequence[ArtefactSource] = (),
) -> InstalledSlot:
    """Stage a version the device produced (a fine-tune of ``parent``), signed with its key.

    The chunks go straight into the local chunk store, cut with the parent's rule so the
    unchanged tensors reuse the parent's chunks. The signature is then verified like any
    pulled version: the device key must be in ``trusted`` with a scope covering
    ``NAME@VERSION`` (e.g. ``digits-cnn@*+jetson-07.*``), or the version is refused. The
    sequence is one above both the parent's and the highest installed
    (:func:`next_local_sequence`); the manifest names the upstream release the lineage
    starts from (``base``), verified from the parent's slot (the parent itself, or the release
    kept beside it: :func:`agent.storage.verify.slot_release`) and kept in the new slot.
    ``current`` is not touched: commit with ``ModelSlots.commit(version)`` once the gates
    pass, or ``discard_staged()``.
    """
    state_dir = Path(state_dir)
    slots = ModelSlots(state_dir, parent.manifest.name)
    store = ChunkStore(state_dir)

    def keep_chunk(ref: ChunkRef, data: bytes) -> None:
        if store.has(ref.sha256):
            return
        with store.append_partial(ref.sha256) as f:  # a fresh partial: dropped below if stale
            f.truncate(0)
            f.write(data)
        store.commit_partial(ref.sha256)

    with StateLock(state_dir):
        sequence = next_local_sequence(slots, parent)
        signed = sign_version(
            name=parent.manifest.name, version=version, sequence=sequence,
            model=content.model, tensors=content.tensors, key=key, on_chunk=keep_chunk,
            parent=parent.version, base=parent.manifest.base_release,
            training=content.training, artefacts=artefacts,
            chunk_size=parent.manifest.chunk_size, pack_below=parent.manifest.pack_below,
            spec_layout=content.layout,
        )
        manifest, verified_by = verify_signed_manifest(
            signed.manifest_bytes, signed.signature_bytes, trusted,
            source=f"{parent.manifest.name}@{version}",
        )
        # A device key's version descends from the parent's upstream release: the parent
        # itself, or the release its slot keeps.
        release = slot_release(parent.path, trusted) if device_signed(manifest, verified_by) \
            else None
        return slots.stage(manifest, signed.manifest_bytes, signed.signature_bytes, store,
                           verified_by, release=release)
