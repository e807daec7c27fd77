"""A/B slots of one model and the atomic ``current`` switch: stage, commit, discard, rollback.

Layout under ``state_dir/models/<name>/``::

    slots/a/, slots/b/      one complete version each (:mod:`agent.storage.slot_folder`):
                            model.safetensors, artefacts/, manifest.json, manifest.sig,
                            a device version's base.manifest.*, COMPLETE (written last),
                            COMMITTED once committed
    current -> slots/a      the active slot
    installed.json          the rollback defence: the highest sequence ever committed, the
                            newest upstream release (base) committed and the highest
                            sequence committed in that release's lineage; its rule is
                            :func:`agent.storage.anti_rollback.refuse_downgrade`

Crash safety, instant by instant (Mender's A/B scheme, applied to a folder): :meth:`stage`
only ever writes the slot ``current`` does not point at. The new slot is built complete under
a temporary name and fsynced while the standby slot (the rollback target) stays as it was;
only then is the old standby renamed aside (``.old-X-*``), the new one renamed into place and
the old one deleted. A crash between those two renames leaves the old one aside and no slot
``X``: the next stage, commit, rollback or discard renames it back
(:meth:`ModelSlots.recover`), so the rollback target is never lost to a half-built
replacement (the price: room for the new version beside both slots while it is built).
:meth:`commit` then switches ``current`` by ``rename(2)`` of a freshly made symlink over the
old one, which is atomic. A crash before that rename leaves the old model active; after it,
the new one; there is no instant where ``current`` names a half-written slot.

Committed or only staged: :meth:`commit` leaves a ``COMMITTED`` marker in the slot it
switches to (the version passed its gates), and :meth:`rollback` goes only to a standby that
carries one. A version staged by a job that died before its commit (killed during its health
check) stays in the standby slot for that job to resume, but can never be activated by a
rollback; the next stage replaces it. Rollback is the same single rename towards the other,
committed slot. The standby slot is also the rollback target: staging a version replaces it.

Lineage: a version signed by a device-scoped key is staged only with the verified upstream
release it descends from (:mod:`registry.lineage`), kept in the slot beside it
(``base.manifest.json``/``.sig``), and anti-rollback counts it by that base, never by itself.

The device job builds on these steps: ``stage()`` a pulled or locally fine-tuned version,
run its gates against the staged slot, then ``commit(version)`` or ``discard_staged()``.
``install()`` is stage + commit, what ``agentctl pull`` does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.storage.anti_rollback import (
    INSTALLED,
    InstalledRecord,
    after_commit,
    read_record,
    refuse_downgrade,
    write_record,
)
from agent.storage.chunk_store import ChunkStore
from agent.storage.lock import StateLock
from agent.storage.nofollow import is_link, read_bytes, real_dir, real_dirs, regular_file
from agent.storage.slot_folder import (
    InstalledSlot,
    build_version,
    mark_committed,
    read_installed,
)
from agent.storage.verify import verify_slot
from registry.atomic import fsync_dir
from registry.errors import (
    CorruptSlotError,
    NoActiveModelError,
    NoPreviousVersionError,
    NoStagedVersionError,
    RefusedError,
    UnsafeStateError,
)
from registry.lineage import SignedRelease, check_descends, device_signed
from registry.manifest import Manifest
from registry.signing import TrustedKey

__all__ = ["SLOT_NAMES", "InstalledSlot", "ModelSlots", "SwitchResult", "build_version",
           "read_installed"]

log = logging.getLogger("agent.storage")

SLOT_NAMES = ("a", "b")
_ASIDE = ".old-"
"""A standby slot renamed aside while its replacement is renamed in (``.old-X-TOKEN``)."""
_LEFTOVER_PREFIXES = (".new-", ".trash-", ".current-", ".tmp-", _ASIDE)


@dataclass(frozen=True)
class SwitchResult:
    name: str
    active: InstalledSlot
    previous: InstalledSlot | None
    changed: bool
    """False when the requested version was already active."""


class ModelSlots:
    """The two slots and the ``current`` pointer of one model name."""

    def __init__(self, state_dir: Path, name: str) -> None:
        self.state_dir = Path(state_dir)
        self.name = name
        self.root = self.state_dir / "models" / name
        self.slots_dir = self.root / "slots"
        self.current_link = self.root / "current"

    # -- reading

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
        installed = read_installed(self.slots_dir / slot, slot)
        if installed is None:
            raise CorruptSlotError(f"{self.current_link} points at an incomplete slot {slot}")
        return installed

    def standby(self) -> InstalledSlot | None:
        """The other slot, when it holds a complete version (staged, or the rollback target)."""
        current = self._current_slot()
        other = self.standby_slot_name()
        if current is None and not (self.slots_dir / other).exists():
            return None
        return read_installed(self.slots_dir / other, other)

    def installed(self, version: str | None = None) -> InstalledSlot:
        """The active version, or the named one if it is in either slot."""
        active = self.active()
        if active is None:
            raise NoActiveModelError(
                f"no model {self.name!r} is installed in {self.state_dir}: pull one first"
            )
        if version is None or active.version == version:
            return active
        standby = self.standby()
        if standby is not None and standby.version == version:
            return standby
        raise NoStagedVersionError(
            f"{self.name}@{version} is not installed in {self.state_dir} (active: "
            f"{active.version})"
        )

    def slot_bytes(self, slot: str) -> int:
        path = self.slots_dir / slot
        if is_link(path) or not path.is_dir():
            return 0
        return sum(p.lstat().st_size for p in path.rglob("*") if stat.S_ISREG(p.lstat().st_mode))

    def standby_slot_name(self) -> str:
        current = self._current_slot()
        return "a" if current is None else SLOT_NAMES[1 - SLOT_NAMES.index(current)]

    def installed_record(self) -> InstalledRecord:
        """What this device has committed of the model (``installed.json``,
        :mod:`agent.storage.anti_rollback`)."""
        def active_base() -> int | None:
            active = self.active()
            return active.manifest.base_release.sequence if active is not None else None

        return read_record(self.root / INSTALLED, active_base)

    def highest_sequence(self) -> int:
        """The highest signed sequence ever committed for this model here (0: none)."""
        return self.installed_record().highest_sequence

    def _record_commit(self, staged: InstalledSlot) -> None:
        rec = self.installed_record()
        new = after_commit(rec, staged.manifest, device_signed=staged.device_signed)
        if new != rec:
            write_record(self.root / INSTALLED, new, staged.version)

    # -- stage / commit / discard

    def stage(
        self, manifest: Manifest, manifest_bytes: bytes, signature_bytes: bytes,
        chunks: ChunkStore, key: TrustedKey, *, release: SignedRelease | None = None,
        allow_downgrade: bool = False,
    ) -> InstalledSlot:
        """Assemble a verified version into the standby slot; ``current`` is not touched.

        ``key`` is the trusted key that verified ``signature_bytes`` over ``manifest_bytes``
        (``registry.signing.verify_signed_manifest``); it is recorded in the slot. A device
        version (``key`` device-scoped) needs ``release``, the verified upstream release its
        ``base`` names (:func:`registry.lineage.check_descends`; LineageError otherwise),
        kept in the slot. Every chunk, tensor and artefact hash is checked while assembling.
        Replaces the standby slot, once the new one is complete.
        """
        check_descends(manifest, key, release, manifest.ref)
        with StateLock(self.state_dir):
            refuse_downgrade(manifest, self.installed_record(), model=self.name,
                             device_signed=device_signed(manifest, key),
                             allow_downgrade=allow_downgrade)
            slots_dir = real_dirs(self.state_dir, "models", self.name, "slots")
            self.clean_leftovers()
            target = self.standby_slot_name()
            build = slots_dir / f".new-{target}-{secrets.token_hex(4)}"
            # Built complete beside the standby slot (the rollback target), which stays as it
            # was until the new one is in place: a kill or an error mid-build loses nothing.
            build_version(manifest, manifest_bytes, signature_bytes, chunks, key, build,
                          release)
            self._swap_in(build, slots_dir / target)
            staged = read_installed(slots_dir / target, target)
            assert staged is not None
            return staged

    def commit(self, version: str, *, manifest_sha256: str | None = None,
               allow_downgrade: bool = False) -> SwitchResult:
        """Switch ``current`` to the staged slot holding ``version`` (one atomic rename), mark
        it committed and record its sequence as the highest installed if it is.

        ``manifest_sha256``: the digest of the manifest the caller staged (its
        ``InstalledSlot.manifest_sha256``); a standby holding another version under the same
        name (replaced by another job or a pull since) is refused, NoStagedVersionError."""
        with StateLock(self.state_dir):
            self.recover()
            previous = self.active()
            staged = self.standby()
            if staged is None or staged.version != version:
                raise NoStagedVersionError(
                    f"{self.name}@{version} is not staged (standby: "
                    f"{staged.version if staged else 'none'}); stage it first"
                )
            if manifest_sha256 is not None and staged.manifest_sha256 != manifest_sha256:
                raise NoStagedVersionError(
                    f"{self.name}@{version} in the standby slot is not the version staged for "
                    f"this commit (its manifest sha256 {staged.manifest_sha256[:16]}, staged "
                    f"{manifest_sha256[:16]}): something replaced it since; not committing"
                )
            refuse_downgrade(staged.manifest, self.installed_record(), model=self.name,
                             device_signed=staged.device_signed,
                             allow_downgrade=allow_downgrade)
            if previous is not None:  # it serves: committed (an older agent left no marker)
                mark_committed(previous)
            mark_committed(staged)
            # Recorded before the switch: a crash in between leaves the record ahead of the
            # active version (harmless), never behind it (a downgrade window).
            self._record_commit(staged)
            self._point_current(staged.slot)
            return SwitchResult(self.name, staged, previous, changed=True)

    def discard_staged(self) -> None:
        """Drop the standby slot (a staged version that failed its gates); active untouched."""
        with StateLock(self.state_dir):
            if self._current_slot() is None and not (self.slots_dir / "a").exists():
                return
            self.recover()
            self._discard(self.slots_dir / self.standby_slot_name())

    def install(
        self, manifest: Manifest, manifest_bytes: bytes, signature_bytes: bytes,
        chunks: ChunkStore, key: TrustedKey, *, release: SignedRelease | None = None,
        allow_downgrade: bool = False,
    ) -> SwitchResult:
        """stage() then commit(); a no-op when these exact manifest bytes are already active."""
        with StateLock(self.state_dir):
            previous = self.active()
            if previous is not None and _manifest_bytes(previous.path) == manifest_bytes:
                return SwitchResult(self.name, previous, self.standby(), changed=False)
            staged = self.stage(manifest, manifest_bytes, signature_bytes, chunks, key,
                                release=release, allow_downgrade=allow_downgrade)
            return self.commit(manifest.version, manifest_sha256=staged.manifest_sha256,
                               allow_downgrade=allow_downgrade)

    def rollback(self, trusted: dict[str, TrustedKey] | None) -> SwitchResult:
        """Make the standby slot active again, after re-verifying it; one atomic rename.

        Only to a committed version (one that passed its gates,
        :data:`agent.storage.slot_folder.COMMITTED`): a version
        staged by a job that never committed it is refused, NoPreviousVersionError naming the
        active version as the last committed one. The explicit way back: allowed below the
        highest sequence (logged), which stays."""
        with StateLock(self.state_dir):
            self.recover()
            active = self.active()
            if active is None:
                raise NoActiveModelError(f"no model {self.name!r} is installed in {self.state_dir}")
            standby = self.standby()
            if standby is None:
                raise NoPreviousVersionError(
                    f"{self.name}: no previous version to roll back to (only "
                    f"{active.version} is installed)"
                )
            if not standby.committed:
                raise NoPreviousVersionError(
                    f"{self.name}: the standby slot holds {standby.version}, staged by a job "
                    "that never committed it (it did not pass its health check, or the job "
                    f"stopped before its commit): not rolling back to it. {active.version}, "
                    "the active version, is the last committed one; to go further back, "
                    "deploy an older version with --allow-downgrade"
                )
            try:
                verify_slot(standby.path, trusted)
            except (RefusedError, OSError) as e:
                raise CorruptSlotError(
                    f"{self.name}: previous version {standby.version} failed verification, not "
                    f"rolling back: {e}"
                ) from None
            mark_committed(active)  # it served: the way forward again is a rollback too
            self._point_current(standby.slot)
            log.warning(
                "rolled back %s from %s to %s", self.name, active.version, standby.version,
                extra={"fields": {
                    "event": "rollback", "model": self.name, "from": active.version,
                    "to": standby.version, "sequence": standby.manifest.sequence,
                    "highest_sequence": self.highest_sequence(),
                }},
            )
            return SwitchResult(self.name, standby, active, changed=True)

    # -- file-system steps

    def _swap_in(self, build: Path, dest: Path) -> None:
        """Put the complete folder ``build`` in place of the slot ``dest``: the old slot is
        renamed aside, the new one in, the old one deleted. A crash between the two renames
        is undone by :meth:`recover`."""
        if is_link(dest):
            raise UnsafeStateError(
                f"{dest} is a symbolic link where a slot folder belongs; refusing to replace "
                "through it: remove it and retry"
            )
        aside = None
        if dest.exists():
            aside = dest.parent / f"{_ASIDE}{dest.name}-{secrets.token_hex(4)}"
            os.rename(dest, aside)
        os.rename(build, dest)
        fsync_dir(dest.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)  # rmtree never follows links inside

    def recover(self) -> None:
        """Undo a stage interrupted between its two renames: a slot missing while its old
        folder is still aside (``.old-X-*``) gets it back. Under the state lock."""
        if not self.slots_dir.is_dir() or is_link(self.slots_dir):
            return
        for name in SLOT_NAMES:
            slot = self.slots_dir / name
            if slot.exists() or is_link(slot):
                continue
            aside = sorted(p for p in self.slots_dir.iterdir()
                           if p.name.startswith(f"{_ASIDE}{name}-") and not is_link(p))
            if aside and read_installed(aside[-1], name) is not None:
                os.rename(aside[-1], slot)
                fsync_dir(self.slots_dir)
                log.warning("restored slot %s of %s, set aside by a stage that was "
                            "interrupted", name, self.name, extra={"fields": {
                                "event": "slot_restored", "model": self.name, "slot": name}})

    def _point_current(self, slot: str) -> None:
        root = real_dirs(self.state_dir, "models", self.name)
        if self.current_link.exists() and not is_link(self.current_link):
            raise CorruptSlotError(f"{self.current_link} is not a symlink")
        tmp = root / f".current-{secrets.token_hex(4)}"
        os.symlink(f"slots/{slot}", tmp)
        os.replace(tmp, self.current_link)  # the switch: atomic on POSIX file systems
        fsync_dir(root)

    def _discard(self, path: Path) -> None:
        if is_link(path):
            raise UnsafeStateError(
                f"{path} is a symbolic link where a slot folder belongs; refusing to delete "
                "through it: remove it and retry"
            )
        if not path.exists():
            return
        # Rename first: a crash mid-delete must not leave a half slot under a real slot name.
        trash = self.slots_dir / f".trash-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, trash)
        fsync_dir(self.slots_dir)
        shutil.rmtree(trash, ignore_errors=True)  # rmtree never follows links inside

    def clean_leftovers(self) -> None:
        """Remove what interrupted stages left (after :meth:`recover` put back a slot set
        aside): half-built folders, trash, temporary links and files."""
        self.recover()
        for folder in (self.slots_dir, self.root):
            real_dir(folder, create=False)
            if not folder.is_dir():
                continue
            for p in folder.iterdir():
                if p.name.startswith(_LEFTOVER_PREFIXES):
                    if p.is_symlink() or not p.is_dir():
                        p.unlink()
                    else:
                        shutil.rmtree(p, ignore_errors=True)


def _manifest_bytes(slot: Path) -> bytes | None:
    with contextlib.suppress(OSError, UnsafeStateError):
        if regular_file(slot / "manifest.json"):
            return read_bytes(slot / "manifest.json")
    return None
