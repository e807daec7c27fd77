"""Re-verify an installed slot end to end before it is trusted again (rollback, load).

A slot holding a device version keeps, beside its own manifest, the signed manifest of the
upstream release it descends from (``base.manifest.json`` / ``base.manifest.sig``): the
lineage rule (:mod:`registry.lineage`) is re-checked from the slot alone.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from agent.storage.assemble import ARTEFACTS_DIR, MODEL_FILE
from agent.storage.nofollow import open_read, read_bytes, regular_file
from registry.errors import (
    CorruptSlotError,
    IntegrityError,
    SpecMismatchError,
    TensorHashError,
    TruncatedError,
)
from registry.lineage import SignedRelease, check_descends, device_signed, verify_release
from registry.manifest import Manifest
from registry.safetensors_io import read_safetensors_index
from registry.signing import MAX_SIGNATURE_BYTES, TrustedKey, verify_signed_manifest

MARKER = "COMPLETE"
BASE_MANIFEST = "base.manifest.json"
BASE_SIGNATURE = "base.manifest.sig"
"""A device version's evidence of its lineage: the upstream release it names as ``base``."""
_HASH_BLOCK = 1 << 20


def read_signature(slot: Path) -> bytes | None:
    """The slot's manifest.sig, or None when it has none."""
    try:
        return read_bytes(slot / "manifest.sig", MAX_SIGNATURE_BYTES + 1)
    except FileNotFoundError:
        return None


def stored_release(slot: Path, trusted: dict[str, TrustedKey]) -> SignedRelease | None:
    """The upstream release kept in ``slot`` as its version's base, verified as one
    (:func:`registry.lineage.verify_release`); None when the slot keeps none."""
    try:
        data = read_bytes(slot / BASE_MANIFEST)
    except FileNotFoundError:
        return None
    try:
        signature: bytes | None = read_bytes(slot / BASE_SIGNATURE, MAX_SIGNATURE_BYTES + 1)
    except FileNotFoundError:
        signature = None
    return verify_release(data, signature, trusted, f"{slot / BASE_MANIFEST}")


def slot_release(slot: Path, trusted: dict[str, TrustedKey]) -> SignedRelease | None:
    """The upstream release the version in ``slot`` descends from, verified: the version
    itself when it is one, else the base kept beside it, checked against the version
    (:func:`registry.lineage.check_descends`). None for a version a releasing key signed
    with a base of its own (nothing to check). What a fine-tune of the slot names as its
    base, and the evidence its own slot keeps."""
    data, source = read_bytes(slot / "manifest.json"), str(slot)
    signature = read_signature(slot)
    manifest, key = verify_signed_manifest(data, signature, trusted, source=source)
    if not device_signed(manifest, key) and manifest.base is None:
        return SignedRelease(manifest, data, signature or b"", key)
    return check_descends(manifest, key, stored_release(slot, trusted), source)


def hash_range(path: Path, start: int, nbytes: int) -> str:
    h = hashlib.sha256()
    with open_read(path) as f:
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
    """Re-check an installed slot end to end: signature and lineage (when keys are given),
    the safetensors structure, every tensor's and artefact's hash. Raises a RefusedError
    subclass."""
    slot = Path(slot)
    if not regular_file(slot / MARKER):
        raise CorruptSlotError(f"{slot} has no {MARKER} marker")
    manifest_bytes = read_bytes(slot / "manifest.json")
    if trusted is not None:
        manifest, key = verify_signed_manifest(
            manifest_bytes, read_signature(slot), trusted, source=str(slot)
        )
        if device_signed(manifest, key):
            check_descends(manifest, key, stored_release(slot, trusted), str(slot))
    else:
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
        if hash_range(src.data.path, src.data.start, t.nbytes) != t.sha256:
            raise TensorHashError(f"{slot / MODEL_FILE}: tensor {t.name} does not match its hash")
    for a in manifest.artefacts:
        path = slot / ARTEFACTS_DIR / a.path
        if not regular_file(path) or os.lstat(path).st_size != a.nbytes:
            raise TruncatedError(f"artefact {path} is missing or has the wrong size")
        if hash_range(path, 0, a.nbytes) != a.sha256:
            raise IntegrityError(f"artefact {path} does not match its hash")
    return manifest
