"""Device-side model storage: the chunk store and A/B slots with an atomic ``current`` switch.

Layout under the state directory::

    lock                               flock: one pull / install / rollback / gc at a time
    chunks/sha256/ab/<hash>            verified chunks, content-addressed, shared by versions
    chunks/partial/<hash>.part         downloads in progress (resumed with HTTP Range)
    models/<name>/slots/a/             one complete install: model.safetensors, artefacts/,
    models/<name>/slots/b/               manifest.json, manifest.sig, COMPLETE (written last)
    models/<name>/current -> slots/a   the active slot

Crash safety, instant by instant (Mender's A/B scheme, applied to a folder): an install only
ever writes the slot ``current`` does not point at. The new slot is built under a temporary
name, fsynced, renamed into place, and only then is ``current`` switched by ``rename(2)`` of a
freshly made symlink over the old one, which is atomic. A crash before that rename leaves the
old model active; after it, the new one; there is no instant where ``current`` names a slot
that is half written. Rollback is the same single rename towards the other complete slot.

Loading goes through safetensors only; a slot's files are re-verified against the signed
manifest before they are trusted again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_core.atomic import fsync_dir, fsync_file
from hpc_core.manifest import (
    ChunkHashError,
    ChunkRef,
    IntegrityError,
    Manifest,
    ManifestError,
    SpecMismatchError,
    TensorHashError,
    TruncatedError,
    build_module,
    check_against_spec,
    read_safetensors_index,
    refuse_pickled_file,
    safetensors_header,
)
from hpc_core.signing import TrustedKey, verify_manifest

SLOT_NAMES = ("a", "b")
MARKER = "COMPLETE"
MODEL_FILE = "model.safetensors"
ARTEFACTS_DIR = "artefacts"
_LEFTOVER_PREFIXES = (".new-", ".trash-", ".current-")
_HASH_BLOCK = 1 << 20


class SlotError(Exception):
    """The device's model storage is not in a state that allows the operation."""


class NoActiveModelError(SlotError):
    pass


class NoPreviousVersionError(SlotError):
    pass


class CorruptSlotError(SlotError):
    pass


class StateBusyError(SlotError):
    """Another process holds the state lock."""


# ---------------------------------------------------------------------------------------------
# State lock


class StateLock:
    """An exclusive flock on ``state_dir/lock``; re-entrant within one thread.

    The kernel drops a flock when its holder dies, so a SIGKILLed pull never wedges the device.
    """

    _local = threading.local()

    def __init__(self, state_dir: Path, wait_s: float = 5.0) -> None:
        self.path = Path(state_dir) / "lock"
        self.wait_s = wait_s

    def _held(self) -> dict[Path, list[int]]:
        if not hasattr(self._local, "held"):
            self._local.held = {}
        return self._local.held  # type: ignore[no-any-return]

    def __enter__(self) -> StateLock:
        held = self._held()
        if self.path in held:
            held[self.path][1] += 1
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise StateBusyError(
                        f"{self.path} is held by pid {owner} (another pull, install or rollback); "
                        "wait for it to finish"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        held[self.path] = [fd, 1]
        return self

    def __exit__(self, *exc: object) -> None:
        held = self._held()
        entry = held[self.path]
        entry[1] -= 1
        if entry[1] == 0:
            del held[self.path]
            os.close(entry[0])  # closing the descriptor releases the flock


# ---------------------------------------------------------------------------------------------
# Chunk store


class ChunkStore:
    """Verified chunks by hash, plus partial downloads.

    Only complete, hash-checked chunks are renamed into ``sha256/``, and every read re-hashes
    the chunk. That read check is what keeps the store honest across power cuts, so chunks are
    not fsynced one by one (an fsync per 4 MiB chunk costs more than the download on eMMC): a
    chunk torn by a power cut is caught, dropped and fetched again. The slot files assembled from
    the chunks are fsynced before ``current`` ever points at them.
    """

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "chunks"
        self.partial_dir = self.root / "partial"

    def path(self, sha256: str) -> Path:
        return self.root / "sha256" / sha256[:2] / sha256

    def partial(self, sha256: str) -> Path:
        return self.partial_dir / f"{sha256}.part"

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def missing(self, chunks: Iterable[ChunkRef]) -> list[ChunkRef]:
        seen: set[str] = set()
        out = []
        for c in chunks:
            if c.sha256 not in seen and not self.has(c.sha256):
                out.append(c)
            seen.add(c.sha256)
        return out

    def partial_bytes(self, chunks: Iterable[ChunkRef]) -> int:
        total = 0
        for c in chunks:
            with contextlib.suppress(FileNotFoundError):
                total += min(self.partial(c.sha256).stat().st_size, c.size)
        return total

    def commit(self, part: Path, sha256: str) -> None:
        """Make a verified partial file a chunk."""
        dest = self.path(sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, dest)

    def read(self, ref: ChunkRef) -> bytes:
        """A chunk's bytes, re-verified; a corrupt or missing chunk is dropped and reported."""
        try:
            data = self.path(ref.sha256).read_bytes()
        except FileNotFoundError:
            raise ChunkHashError(
                f"chunk {ref.sha256[:16]} is missing from the local store {self.root}: pull again",
                ref.sha256,
            ) from None
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            self.remove(ref.sha256)
            raise ChunkHashError(
                f"local chunk {ref.sha256[:16]} is corrupt (disk error or power loss); it was "
                "removed, pull again to fetch it",
                ref.sha256,
            )
        return data

    def remove(self, sha256: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(sha256).unlink()

    def hashes(self) -> set[str]:
        base = self.root / "sha256"
        if not base.is_dir():
            return set()
        return {p.name for d in base.iterdir() if d.is_dir() for p in d.iterdir()}

    def clear_partials(self) -> None:
        if self.partial_dir.is_dir():
            for p in self.partial_dir.iterdir():
                p.unlink()


# ---------------------------------------------------------------------------------------------
# Slots


@dataclass(frozen=True)
class InstalledSlot:
    slot: str
    path: Path
    manifest: Manifest

    @property
    def version(self) -> str:
        return self.manifest.version


@dataclass(frozen=True)
class SwitchResult:
    name: str
    active: InstalledSlot
    previous: InstalledSlot | None
    changed: bool
    """False when the requested version was already active."""


def _read_installed(path: Path, slot: str) -> InstalledSlot | None:
    """A slot with its COMPLETE marker and a parsable manifest, or None."""
    if not (path / MARKER).is_file():
        return None
    try:
        manifest = Manifest.from_bytes((path / "manifest.json").read_bytes(), source=str(path))
    except (OSError, ManifestError):
        return None
    return InstalledSlot(slot, path, manifest)


class ModelSlots:
    """The two slots and the ``current`` pointer of one model name."""

    def __init__(self, state_dir: Path, name: str) -> None:
        self.state_dir = Path(state_dir)
        self.name = name
        self.root = self.state_dir / "models" / name
        self.slots_dir = self.root / "slots"
        self.current_link = self.root / "current"

    def _current_slot(self) -> str | None:
        try:
            target = os.readlink(self.current_link)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.EINVAL:  # a regular file where the symlink should be
                raise CorruptSlotError(f"{self.current_link} is not a symlink") from None
            raise
        for s in SLOT_NAMES:
            if target == f"slots/{s}":
                return s
        # Never follow anything else: a link could point anywhere on the file system.
        raise CorruptSlotError(f"{self.current_link} points at {target!r}, not slots/a or slots/b")

    def active(self) -> InstalledSlot | None:
        slot = self._current_slot()
        if slot is None:
            return None
        installed = _read_installed(self.slots_dir / slot, slot)
        if installed is None:
            raise CorruptSlotError(f"{self.current_link} points at an incomplete slot {slot}")
        return installed

    def standby(self) -> InstalledSlot | None:
        """The other slot, when it holds a complete install (the rollback target)."""
        current = self._current_slot()
        if current is None:
            return None
        other = SLOT_NAMES[1 - SLOT_NAMES.index(current)]
        return _read_installed(self.slots_dir / other, other)

    def slot_bytes(self, slot: str) -> int:
        path = self.slots_dir / slot
        if not path.is_dir():
            return 0
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())

    def standby_slot_name(self) -> str:
        current = self._current_slot()
        return "a" if current is None else SLOT_NAMES[1 - SLOT_NAMES.index(current)]

    def install(
        self, manifest: Manifest, manifest_bytes: bytes, signature_bytes: bytes, chunks: ChunkStore
    ) -> SwitchResult:
        """Assemble a verified version into the standby slot, then switch ``current`` to it."""
        with StateLock(self.state_dir):
            previous = self.active()
            if previous is not None and _manifest_bytes(previous.path) == manifest_bytes:
                return SwitchResult(self.name, previous, self.standby(), changed=False)
            self.slots_dir.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers()
            target = self.standby_slot_name()
            # The standby slot is not in use; dropping it first frees its disk for the new one.
            self._discard(self.slots_dir / target)
            build = self.slots_dir / f".new-{target}-{secrets.token_hex(4)}"
            build.mkdir()
            try:
                _assemble(manifest, chunks, build)
                (build / "manifest.json").write_bytes(manifest_bytes)
                (build / "manifest.sig").write_bytes(signature_bytes)
                for f in ("manifest.json", "manifest.sig"):
                    fsync_file(build / f)
                marker = {
                    "name": manifest.name,
                    "version": manifest.version,
                    "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
                }
                (build / MARKER).write_text(json.dumps(marker) + "\n")
                fsync_file(build / MARKER)
                fsync_dir(build)
            except BaseException:
                shutil.rmtree(build, ignore_errors=True)
                raise
            os.rename(build, self.slots_dir / target)
            fsync_dir(self.slots_dir)
            self._point_current(target)
            active = self.active()
            assert active is not None
            return SwitchResult(self.name, active, previous, changed=True)

    def rollback(self, trusted: dict[str, TrustedKey] | None) -> SwitchResult:
        """Make the standby slot active again, after re-verifying it; one atomic rename."""
        with StateLock(self.state_dir):
            active = self.active()
            if active is None:
                raise NoActiveModelError(f"no model {self.name!r} is installed in {self.state_dir}")
            standby = self.standby()
            if standby is None:
                raise NoPreviousVersionError(
                    f"{self.name}: no previous version to roll back to (only "
                    f"{active.version} is installed)"
                )
            try:
                verify_slot(standby.path, trusted)
            except (ManifestError, OSError) as e:
                raise CorruptSlotError(
                    f"{self.name}: previous version {standby.version} failed verification, not "
                    f"rolling back: {e}"
                ) from None
            self._point_current(standby.slot)
            return SwitchResult(self.name, standby, active, changed=True)

    def _point_current(self, slot: str) -> None:
        tmp = self.root / f".current-{secrets.token_hex(4)}"
        os.symlink(f"slots/{slot}", tmp)
        os.replace(tmp, self.current_link)  # the switch: atomic on POSIX file systems
        fsync_dir(self.root)

    def _discard(self, path: Path) -> None:
        if not (path.exists() or path.is_symlink()):
            return
        # Rename first: a crash mid-delete must not leave a half slot under a real slot name.
        trash = self.slots_dir / f".trash-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, trash)
        fsync_dir(self.slots_dir)
        shutil.rmtree(trash, ignore_errors=True)

    def _clean_leftovers(self) -> None:
        for folder in (self.slots_dir, self.root):
            if not folder.is_dir():
                continue
            for p in folder.iterdir():
                if p.name.startswith(_LEFTOVER_PREFIXES):
                    if p.is_symlink() or p.is_file():
                        p.unlink()
                    else:
                        shutil.rmtree(p, ignore_errors=True)


def _manifest_bytes(slot: Path) -> bytes | None:
    try:
        return (slot / "manifest.json").read_bytes()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# Assembly and verification


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


def _assemble(manifest: Manifest, chunks: ChunkStore, dest: Path) -> None:
    """One pass over the chunks: write model.safetensors and the artefacts, verifying every
    chunk, tensor and artefact hash on the way. Memory: one chunk."""
    model_path = dest / MODEL_FILE
    files: list[Any] = []
    try:
        model_file = open(model_path, "wb")  # noqa: SIM115 - closed in finally with the rest
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
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "wb")  # noqa: SIM115
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


def _hash_range(path: Path, start: int, nbytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = nbytes
        while left:
            block = f.read(min(left, _HASH_BLOCK))
            if not block:
                raise TruncatedError(f"{path} ends before byte {start + nbytes}")
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def verify_slot(slot: Path, trusted: dict[str, TrustedKey] | None) -> Manifest:
    """Re-check an installed slot end to end: signature (when keys are given), the safetensors
    structure, every tensor's and artefact's hash. Raises a ManifestError subclass."""
    slot = Path(slot)
    if not (slot / MARKER).is_file():
        raise CorruptSlotError(f"{slot} has no {MARKER} marker")
    manifest_bytes = (slot / "manifest.json").read_bytes()
    if trusted is not None:
        sig = slot / "manifest.sig"
        verify_manifest(
            manifest_bytes, sig.read_bytes() if sig.is_file() else None, trusted, source=str(slot)
        )
    manifest = Manifest.from_bytes(manifest_bytes, source=str(slot / "manifest.json"))
    index = {t.name: t for t in read_safetensors_index(slot / MODEL_FILE)}
    if set(index) != {t.name for t in manifest.tensors}:
        raise SpecMismatchError(f"{slot / MODEL_FILE}: tensor names differ from the manifest")
    for t in manifest.tensors:
        src = index[t.name]
        if (src.dtype, tuple(src.shape)) != (t.dtype, tuple(t.shape)):
            raise SpecMismatchError(
                f"{slot / MODEL_FILE}: tensor {t.name} is {src.dtype}"
                f"{list(src.shape)}, manifest says {t.dtype}{list(t.shape)}"
            )
        if _hash_range(src.data.path, src.data.start, t.nbytes) != t.sha256:
            raise TensorHashError(f"{slot / MODEL_FILE}: tensor {t.name} does not match its hash")
    for a in manifest.artefacts:
        path = slot / ARTEFACTS_DIR / a.path
        if not path.is_file() or path.stat().st_size != a.nbytes:
            raise TruncatedError(f"artefact {path} is missing or has the wrong size")
        if _hash_range(path, 0, a.nbytes) != a.sha256:
            raise IntegrityError(f"artefact {path} does not match its hash")
    return manifest


# ---------------------------------------------------------------------------------------------
# Loading, listing, garbage collection


@dataclass
class LoadedModel:
    module: Any
    """torch.nn.Module with the slot's weights, in eval mode."""
    manifest: Manifest
    slot: Path


def load_active(
    state_dir: Path,
    name: str,
    *,
    trusted: dict[str, TrustedKey] | None = None,
    verify: bool = False,
    device: str = "cpu",
    allow_custom: bool = False,
) -> LoadedModel:
    """Build the active model and load its weights through safetensors (never a pickle).

    ``trusted`` re-checks the signature; ``verify`` also re-hashes every tensor.
    """
    from safetensors.torch import load_file

    slots = ModelSlots(state_dir, name)
    active = slots.active()
    if active is None:
        raise NoActiveModelError(f"no model {name!r} is installed in {state_dir}")
    if verify:
        manifest = verify_slot(active.path, trusted)
    else:
        manifest = active.manifest
        if trusted is not None:
            sig = active.path / "manifest.sig"
            verify_manifest(
                (active.path / "manifest.json").read_bytes(),
                sig.read_bytes() if sig.is_file() else None,
                trusted,
                source=str(active.path),
            )
        read_safetensors_index(active.path / MODEL_FILE)  # refuses a pickle swapped in
    check_against_spec(manifest, allow_custom=allow_custom)
    module = build_module(manifest.model, allow_custom=allow_custom)
    module.load_state_dict(load_file(str(active.path / MODEL_FILE), device=device), strict=True)
    return LoadedModel(module.to(device).eval(), manifest, active.path)


def installed_models(state_dir: Path) -> list[str]:
    models = Path(state_dir) / "models"
    if not models.is_dir():
        return []
    return sorted(p.name for p in models.iterdir() if p.is_dir() and not p.name.startswith("."))


@dataclass(frozen=True)
class GcReport:
    removed_chunks: int
    removed_bytes: int
    kept_chunks: int


def gc(state_dir: Path) -> GcReport:
    """Delete chunks no complete slot of any model references, partial downloads, leftovers."""
    with StateLock(state_dir):
        keep: set[str] = set()
        for name in installed_models(state_dir):
            slots = ModelSlots(state_dir, name)
            slots._clean_leftovers()
            for s in SLOT_NAMES:
                installed = _read_installed(slots.slots_dir / s, s)
                if installed is not None:
                    keep |= {c.sha256 for c in installed.manifest.chunks}
        store = ChunkStore(state_dir)
        removed = removed_bytes = 0
        for sha in store.hashes() - keep:
            p = store.path(sha)
            removed_bytes += p.stat().st_size
            p.unlink()
            removed += 1
        store.clear_partials()
        return GcReport(removed, removed_bytes, len(keep))
