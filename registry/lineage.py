"""Lineage: every version a device signs descends from an upstream release, and that is
checked against the release's own signed manifest, never taken on the version's word.

A device's key is scoped to its own versions (``MODEL@*+DEVICE.*``,
:meth:`registry.signing.TrustedKey.may_release` is False for it): inside that scope it could
sign a manifest with no ``base`` and any sequence, and a device that took it for an upstream
release would move its anti-rollback record to that sequence and refuse every real release
below it. So wherever a version is accepted (the registry server's upload rules, a device's
pull, stage, re-verification and anti-rollback record), a manifest signed by a device-scoped
key must name a ``base`` whose manifest verifies against a key that may release the model,
names no base of its own, and has exactly the version and sequence the child claims for it.
The evidence travels with the version: the registry holds the base beside it, a device keeps
the base's manifest and signature in the slot (``agent.storage.verify``).
"""

from __future__ import annotations

from dataclasses import dataclass

from registry.errors import LineageError
from registry.manifest import Manifest
from registry.signing import TrustedKey, verify_signed_manifest


@dataclass(frozen=True)
class SignedRelease:
    """An upstream release's manifest and signature, and the trusted key that verified them
    (one that may release the model): the evidence a device version's ``base`` is real."""

    manifest: Manifest
    manifest_bytes: bytes
    signature_bytes: bytes
    key: TrustedKey


def device_signed(manifest: Manifest, key: TrustedKey) -> bool:
    """Whether ``key`` (the trusted key that verified ``manifest``) is device-scoped for the
    model: what it signs is a device version, never an upstream release."""
    return not key.may_release(manifest.name)


def check_release(manifest: Manifest, key: TrustedKey, source: str) -> None:
    """``manifest``, verified by ``key``, is an upstream release: signed by a key that may
    release the model, and naming no base of its own. LineageError otherwise."""
    if device_signed(manifest, key):
        raise LineageError(
            f"{source}: {manifest.ref} is signed by {key.name} ({key.key_id}), a device-scoped "
            f"key (scope {list(key.scope)}): it is not an upstream release"
        )
    if manifest.base is not None:
        raise LineageError(
            f"{source}: {manifest.ref} names a base of its own ({manifest.base.version}): it "
            "is a device version, not an upstream release"
        )


def verify_release(manifest_bytes: bytes, signature_bytes: bytes | None,
                   trusted: dict[str, TrustedKey], source: str) -> SignedRelease:
    """Verify these bytes as an upstream release (signature, schema, scope, then
    :func:`check_release`); a SignatureError subclass otherwise."""
    manifest, key = verify_signed_manifest(manifest_bytes, signature_bytes, trusted, source)
    check_release(manifest, key, source)
    return SignedRelease(manifest, manifest_bytes, signature_bytes or b"", key)


def check_descends(manifest: Manifest, key: TrustedKey, release: SignedRelease | None,
                   source: str) -> SignedRelease | None:
    """The lineage rule for ``manifest``, verified by ``key``. An upstream-signed version
    needs no evidence (None is returned). A device-signed one must name a ``base``, and
    ``release`` must be that very upstream release (name, version and sequence), verified
    (:func:`verify_release`); it is returned. LineageError otherwise."""
    if not device_signed(manifest, key):
        return None
    base = manifest.base
    if base is None:
        raise LineageError(
            f"{source}: {manifest.ref} is signed by {key.name} ({key.key_id}), a device-scoped "
            "key, and names no upstream base: a device key can never make an upstream release"
        )
    claimed = f"{manifest.name}@{base.version} (sequence {base.sequence})"
    if release is None:
        raise LineageError(
            f"{source}: {manifest.ref} is signed by device-scoped key {key.name} and names the "
            f"base {claimed}, whose signed manifest is not at hand to verify it: refused"
        )
    got = release.manifest
    check_release(got, release.key, f"base of {manifest.ref}")
    if (got.name, got.version, got.sequence) != (manifest.name, base.version, base.sequence):
        raise LineageError(
            f"{source}: {manifest.ref} names the base {claimed}, but the upstream release "
            f"there is {got.ref} with sequence {got.sequence}: refused"
        )
    return release
