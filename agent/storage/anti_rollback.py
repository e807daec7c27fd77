"""Anti-rollback: the rule by which a device refuses to go back to an older signed version.

Whoever can serve files to a device (a registry mirror, the network path) can replay an older
version that is still validly signed: its signature cannot tell it from a new one, the device's
own memory can. ``models/<name>/installed.json``, beside the model's slots, records what was
committed; :func:`refuse_downgrade` holds every pull, stage and commit to it, and
:func:`after_commit` moves it on (never back).

Versions are compared like with like, along the manifest's lineage (:func:`release_of`):
upstream releases by their own sequence, a device's fine-tunes within the release they start
from. Which one a version is, is decided by the key that verified it, never by the manifest:
a version a device-scoped key signed is a device version, its release the ``base`` it names
(checked against that release's own signed manifest when it was accepted,
:mod:`registry.lineage`), so a device-signed version never moves the upstream sequence, and
one naming no base is refused here too. So a device that fine-tuned release 1 (its version signed 4)
still takes release 2 (signed 3 upstream), and a replay of release 1 stays refused. The explicit
ways back are ``agentctl rollback`` (to the standby slot, re-verified) and a pull with
``--allow-downgrade``, which is logged; neither lowers the record.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.storage.nofollow import read_bytes
from registry.atomic import write_json_atomic
from registry.errors import CorruptSlotError, DowngradeError, LineageError, MalformedJsonError
from registry.jsonsafe import loads_strict
from registry.manifest import BaseRelease, Manifest

log = logging.getLogger("agent.storage")

INSTALLED = "installed.json"


@dataclass(frozen=True)
class InstalledRecord:
    """``installed.json``: what this device has committed of one model (0: nothing yet)."""

    highest_sequence: int = 0
    """Every version ever committed here; a new local version signs one above it."""
    base_sequence: int = 0
    """The newest upstream release committed, directly or as the base of a fine-tune."""
    lineage_sequence: int = 0
    """The highest sequence committed among the versions of that release."""


def read_record(path: Path, active_base: Callable[[], int | None]) -> InstalledRecord:
    """The record at ``path``; an empty one when there is none. A record from before lineage
    existed holds only ``highest_sequence``: the active version's base release
    (``active_base()``, None when nothing is active) stands in for the rest. CorruptSlotError
    when it is unreadable: it guards against downgrades, so it is never silently reset."""
    try:
        doc = loads_strict(read_bytes(path, 1 << 16), str(path))
    except FileNotFoundError:
        return InstalledRecord()
    except MalformedJsonError as e:
        raise CorruptSlotError(f"{path} is unreadable ({e}): it guards against "
                               "downgrades, restore it rather than delete it") from None
    rec = doc if isinstance(doc, dict) else {}
    highest = rec.get("highest_sequence")
    if not isinstance(highest, int) or isinstance(highest, bool) or highest < 0:
        raise CorruptSlotError(f"{path}: bad highest_sequence {highest!r}: it guards "
                               "against downgrades, restore it rather than delete it")
    if "base_sequence" not in rec:
        base = active_base()
        return InstalledRecord(highest, highest if base is None else base, highest)
    out = {}
    for k in ("base_sequence", "lineage_sequence"):
        v = rec.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= highest:
            raise CorruptSlotError(f"{path}: bad {k} {v!r}")
        out[k] = v
    return InstalledRecord(highest, **out)


def release_of(manifest: Manifest, *, device_signed: bool) -> BaseRelease:
    """The upstream release ``manifest``'s lineage starts from, as anti-rollback compares it:
    an upstream release is its own; a device-signed version's is the ``base`` it names, never
    itself (LineageError when it names none: a device key cannot make an upstream release).
    ``device_signed``: the key that verified it is device-scoped
    (:func:`registry.lineage.device_signed`)."""
    if device_signed and manifest.base is None:
        raise LineageError(
            f"{manifest.ref} was signed by a device-scoped key and names no upstream base: it "
            "can never count as an upstream release here"
        )
    return manifest.base_release


def refuse_downgrade(manifest: Manifest, record: InstalledRecord, *, model: str,
                     device_signed: bool, allow_downgrade: bool = False) -> None:
    """Refuse ``manifest`` as a possible rollback attack (DowngradeError) unless it is no older
    than what ``record`` says was committed here: its upstream release (:func:`release_of`)
    is newer than the newest committed, or it is that same release's lineage at a sequence no
    lower than the highest committed from it. An older release, a version of an older base,
    or a lower sequence within the newest base's lineage is refused. ``allow_downgrade``:
    installed on purpose, logged instead of refused."""
    base = release_of(manifest, device_signed=device_signed).sequence
    if base > record.base_sequence or (
            base == record.base_sequence and manifest.sequence >= record.lineage_sequence):
        return
    fields = {"model": model, "version": manifest.version,
              "sequence": manifest.sequence, "base_sequence": base, **{
                  f"installed_{k}": v for k, v in dataclasses.asdict(record).items()}}
    if base < record.base_sequence:
        why = (f"its upstream release has sequence {base}, below {record.base_sequence}, "
               "the newest release committed here")
    else:
        why = (f"it has sequence {manifest.sequence}, below {record.lineage_sequence}, the "
               "highest committed here from the same upstream release")
    if not allow_downgrade:
        raise DowngradeError(
            f"{manifest.ref}: {why}: refused as a possible rollback attack (to go back on "
            f"purpose, `agentctl rollback` or pull with --allow-downgrade)"
        )
    log.warning("downgrade allowed: installing %s (%s)", manifest.ref, why,
                extra={"fields": {"event": "downgrade", **fields}})


def after_commit(record: InstalledRecord, manifest: Manifest, *,
                 device_signed: bool) -> InstalledRecord:
    """The record once ``manifest`` is committed: the highest sequence moves up to it; a newer
    release (:func:`release_of`: a device-signed version's base, never itself) becomes the
    base with the version's sequence as the lineage's highest; a version of the same release
    raises the lineage's highest. Nothing ever moves down."""
    base = release_of(manifest, device_signed=device_signed).sequence
    new = dataclasses.replace(
        record, highest_sequence=max(record.highest_sequence, manifest.sequence))
    if base > record.base_sequence:
        new = dataclasses.replace(new, base_sequence=base, lineage_sequence=manifest.sequence)
    elif base == record.base_sequence:
        new = dataclasses.replace(
            new, lineage_sequence=max(record.lineage_sequence, manifest.sequence))
    return new


def write_record(path: Path, record: InstalledRecord, version: str) -> None:
    """Write ``record`` durably, naming the ``version`` whose commit moved it."""
    write_json_atomic(path, {**dataclasses.asdict(record), "version": version})
