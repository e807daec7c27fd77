"""What ``registry.serve`` accepts, object by object, and how it commits it.

The folder holds only the registry's own layout (:mod:`registry.names`); the server reads and
writes nothing else. The honest writer (:func:`registry.publish.publish_version`) sends, in
order, the chunks the registry lacks, ``manifest.sig``, ``manifest.json`` and the
``_sequence.json`` counter; each is checked as it arrives:

* a **chunk** is stored only if its bytes hash to its key; one already there is left alone;
* a **signature** must name a trusted key that the uploader owns; until its manifest arrives
  it waits in the uploader's own pending area, invisible to readers;
* a **manifest** must verify against that pending signature, be for the name and version of
  its path, be signed by a key the uploader owns whose scope covers it, belong to the
  uploader (a device writes only ``NAME@*+DEVICE_ID.*``; those belong to no one else),
  descend from an upstream release stored here when a device sends it or a device-scoped key
  signed it, and name only chunks already stored. Under a per-model lock it then gets its
  sequence checked against the counter (a device's must be the very next one, upstream's any
  higher one; a loser of a race gets 409 and signs again with the next), the counter moves
  on, the signature and then the manifest appear;
* the **counter** belongs to the server: a client's write of it is accepted, and ignored,
  only when it repeats what a committed manifest says.

Nothing is ever overwritten: an object that exists answers 409, except a byte-identical
repeat (a retried request whose answer was lost), which answers 200.

Who may write what is decided by four functions, each stating its rule: :func:`owns_key`
(whose signatures an uploader may send), :func:`check_may_write_version` (whose versions are
whose), :func:`check_descends_from_upstream` (a device never publishes an upstream release)
and :func:`check_sequence_moves_on` (the counter only moves on).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from registry.atomic import fsync_dir, write_bytes_atomic
from registry.errors import (
    KeyScopeError,
    LineageError,
    MalformedJsonError,
    RefusedError,
    SignatureError,
    UnknownKeyError,
)
from registry.jsonsafe import loads_strict
from registry.lineage import SignedRelease, device_signed, verify_release
from registry.manifest import MAX_MANIFEST_BYTES, Manifest
from registry.names import (
    CHUNK_PREFIX,
    check_model_name,
    check_sha256,
    check_version,
    chunk_key,
    manifest_key,
    sequence_key,
    signature_key,
)
from registry.principals import Authority, Principal
from registry.signing import MAX_SIGNATURE_BYTES, TrustedKey, verify_signed_manifest

MAX_SEQUENCE_BYTES = 4096
MAX_PENDING_PER_PRINCIPAL = 32
"""Signatures a principal may have waiting for their manifests; the oldest goes first."""
STATE_DIR = ".serve"
"""The server's own files inside the registry folder (uploads in flight, pending signatures,
locks); never served, since no registry key starts with '.'."""

Kind = Literal["chunk", "signature", "manifest", "sequence"]


class Refused(Exception):
    """A write the server will not take: the HTTP status and a message for the uploader."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- who may write what: the decisions, each on its own


def owns_key(who: Principal, authority: Authority, key: TrustedKey) -> bool:
    """Whether ``who`` may upload what ``key`` signs: a principal uploads signatures only by the
    keys it owns (``principals.json``); a trusted key no principal owns signs nothing that is
    uploaded here."""
    owner = authority.owner_of(key)
    return owner is not None and owner.name == who.name


def check_may_write_version(who: Principal, authority: Authority, name: str,
                            version: str) -> None:
    """Whose versions are whose: a device writes only its own, ``NAME@*+DEVICE_ID.*``, and those
    belong to no one else, upstream included. Refused (403) otherwise."""
    label = f"{name}@{version}"
    device = authority.device_owning(version)
    if who.kind == "device" and (device is None or device.name != who.name):
        raise Refused(403, f"{label}: device {who.device_id} may write only its own "
                           f"versions, {name}@*+{who.device_id}.*")
    if who.kind == "upstream" and device is not None:
        raise Refused(403, f"{label}: versions *+{device.device_id}.* belong to device "
                           f"{device.device_id}")


def check_descends_from_upstream(who: Principal, authority: Authority, manifest: Manifest,
                                 key: TrustedKey, base: SignedRelease | None) -> None:
    """A version a device uploads, or one a device-scoped key signed, is a device version: it
    must name an upstream ``base`` (403 otherwise: a device can never publish an upstream
    release), stored here (``base`` None: 409), signed by a key that may release the model
    and that no device owns, naming no base of its own, with the very version and sequence
    the child claims (403 otherwise). ``base``: that release as read from the folder and
    verified (:func:`registry.lineage.verify_release`)."""
    if who.kind != "device" and not device_signed(manifest, key):
        return
    label = manifest.ref
    if manifest.base is None:
        raise Refused(403, f"{label}: a device version must name the upstream release it was "
                           "made from (base); a device can never publish an upstream release")
    claimed = f"{manifest.name}@{manifest.base.version}"
    if base is None:
        raise Refused(409, f"{label}: its base {claimed} is not an upstream release in this "
                           "registry: a device version descends from one published here")
    owner = authority.owner_of(base.key)
    if owner is not None and owner.kind == "device":
        raise Refused(403, f"{label}: its base {claimed} is signed by {base.key.name}, a "
                           f"device's key ({owner.name}): not an upstream release")
    got = base.manifest
    if (got.version, got.sequence) != (manifest.base.version, manifest.base.sequence):
        raise Refused(403, f"{label}: it names the base {claimed} with sequence "
                           f"{manifest.base.sequence}; the upstream release has sequence "
                           f"{got.sequence}")


def check_sequence_moves_on(who: Principal, manifest: Manifest, highest: int) -> None:
    """A new version's sequence moves its model's counter (``highest``) on: a device's must be
    the very next one, upstream's any higher one. Refused (409) otherwise: taken, or out of
    order, and the loser of a race signs again with the next."""
    if manifest.sequence <= highest or (
        who.kind == "device" and manifest.sequence != highest + 1
    ):
        raise Refused(409, f"{manifest.name}@{manifest.version}: sequence {manifest.sequence} "
                           f"is taken or out of order: the next for {manifest.name} is "
                           f"{highest + 1}; sign again with it")


@dataclass(frozen=True)
class ObjectKey:
    kind: Kind
    key: str
    name: str = ""
    version: str = ""

    @property
    def max_bytes(self) -> int | None:
        """The largest body this object may have (chunks: the server's own limit)."""
        return {"signature": MAX_SIGNATURE_BYTES, "manifest": MAX_MANIFEST_BYTES,
                "sequence": MAX_SEQUENCE_BYTES}.get(self.kind)


def parse_key(key: str) -> ObjectKey | None:
    """The registry object ``key`` names, or None when it is none of the layout's."""
    parts = key.split("/")
    try:
        if key.startswith(CHUNK_PREFIX + "/") and len(parts) == 4:
            digest = check_sha256(parts[3])
            if parts[2] == digest[:2] and key == chunk_key(digest):
                return ObjectKey("chunk", key)
        elif len(parts) == 3 and parts[2] in ("manifest.json", "manifest.sig"):
            name, version = check_model_name(parts[0]), check_version(parts[1])
            kind: Kind = "manifest" if parts[2] == "manifest.json" else "signature"
            return ObjectKey(kind, key, name, version)
        elif len(parts) == 2 and key == sequence_key(parts[0]):
            return ObjectKey("sequence", key, check_model_name(parts[0]))
    except ValueError:
        pass
    return None


class RegistryFolder:
    """The served folder: reads by layout key, writes through the rules above."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.state = self.root / STATE_DIR
        for sub in ("incoming", "pending", "locks"):
            (self.state / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
        for leftover in (self.state / "incoming").iterdir():  # bodies of a crashed run
            leftover.unlink(missing_ok=True)
        # Verifying holds a whole manifest (up to 64 MiB) in memory: two at a time at most.
        self._verifying = threading.BoundedSemaphore(2)

    def path(self, ok: ObjectKey) -> Path:
        return self.root / ok.key

    def incoming(self) -> Path:
        """A fresh temporary file name for an upload's body (same file system as the root)."""
        return self.state / "incoming" / secrets.token_hex(8)

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def accept(self, who: Principal, authority: Authority, ok: ObjectKey, body: Path,
               sha256: str) -> int:
        """Take the uploaded ``body`` (already on disk, its sha256 computed while it streamed)
        as ``ok``; returns 201 (stored) or 200 (already there, identical). Refused otherwise."""
        if ok.kind == "chunk":
            return self._chunk(ok, body, sha256)
        if ok.kind == "signature":
            return self._signature(who, authority, ok, body)
        if ok.kind == "manifest":
            return self._manifest(who, authority, ok, body)
        return self._sequence(ok, body)

    # -- chunks

    def _chunk(self, ok: ObjectKey, body: Path, sha256: str) -> int:
        if ok.key != chunk_key(sha256):
            raise Refused(400, f"{ok.key}: the bytes sent hash to {sha256}: a chunk's key is "
                               "the sha256 of its bytes")
        return self._place(body, self.path(ok), same_if_exists=True)

    # -- signatures

    def _pending(self, who: Principal, ok: ObjectKey) -> Path:
        return self.state / "pending" / who.name / f"{ok.name}@{ok.version}.sig"

    def _signature(self, who: Principal, authority: Authority, ok: ObjectKey, body: Path) -> int:
        data = body.read_bytes()
        try:
            doc = loads_strict(data, "manifest.sig", max_bytes=MAX_SIGNATURE_BYTES)
            kid = doc["key_id"] if isinstance(doc, dict) else None
            if not isinstance(kid, str):
                raise KeyError("key_id")
        except (MalformedJsonError, KeyError) as e:
            raise Refused(400, f"{ok.key}: not a signature document ({e})") from None
        key = authority.keys.get(kid)
        if key is None:
            raise Refused(403, f"{ok.key}: signed by key {str(kid)[:16]!r}, which this registry "
                               "does not trust")
        if not owns_key(who, authority, key):
            owner = authority.owner_of(key)
            raise Refused(403, f"{ok.key}: key {key.name} belongs to "
                               f"{owner.name if owner else 'no principal'}, not to {who.name}")
        final = self.path(ok)
        if self.path(ObjectKey("manifest", manifest_key(ok.name, ok.version))).exists():
            return self._same(final, data, ok)
        pending = self._pending(who, ok)
        pending.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._evict_pending(pending.parent)
        os.replace(body, pending)  # the uploader's own area: a re-signed retry replaces it
        return 201

    def _evict_pending(self, folder: Path) -> None:
        waiting = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in waiting[: max(0, len(waiting) - MAX_PENDING_PER_PRINCIPAL + 1)]:
            old.unlink(missing_ok=True)

    # -- manifests

    def _manifest(self, who: Principal, authority: Authority, ok: ObjectKey, body: Path) -> int:
        final = self.path(ok)
        data = body.read_bytes()
        if final.exists():
            return self._same(final, data, ok)
        pending = self._pending(who, ok)
        try:
            signature = pending.read_bytes()
        except FileNotFoundError:
            raise Refused(409, f"{ok.key}: no manifest.sig from {who.name} for {ok.name}@"
                               f"{ok.version}: PUT the signature first") from None
        label = f"{ok.name}@{ok.version}"
        with self._verifying:
            try:
                manifest, key = verify_signed_manifest(data, signature, authority.keys, label)
            except KeyScopeError:  # its own message names the server's files: not for clients
                kid = loads_strict(signature, "manifest.sig")["key_id"]
                scope = list(authority.keys[kid].scope)
                raise Refused(403, f"{label}: not covered by the scope {scope} of the key that "
                                   "signed it") from None
            except UnknownKeyError:  # its own message lists every trusted key
                why = f"{label}: signed by a key this registry does not trust"
                raise Refused(403, why) from None
            except SignatureError as e:
                raise Refused(403, str(e)) from None
            except RefusedError as e:  # schema, names, JSON: the bytes are not a manifest
                raise Refused(400, str(e)) from None
        if (manifest.name, manifest.version) != (ok.name, ok.version):
            raise Refused(400, f"{ok.key}: the signed manifest is {manifest.ref}")
        if not owns_key(who, authority, key):
            raise Refused(403, f"{label}: signed by {key.name}, a key {who.name} does not own")
        check_may_write_version(who, authority, ok.name, ok.version)
        check_descends_from_upstream(who, authority, manifest, key,
                                     self._upstream_base(authority, manifest))
        missing = [c.sha256 for c in manifest.chunks
                   if not (self.root / chunk_key(c.sha256)).is_file()]
        if missing:
            raise Refused(409, f"{label}: {len(missing)} of its chunks are not in the registry "
                               f"(first: {missing[0]}): PUT the chunks before the manifest")
        with self._model_lock(ok.name):
            if final.exists():  # a twin request won the lock first
                return self._same(final, data, ok)
            check_sequence_moves_on(who, manifest, self.highest_sequence(ok.name))
            # Counter first: a crash after it leaves a gap in the sequence, never a reuse.
            final.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self.root / sequence_key(ok.name), _counter(manifest.sequence,
                                                                           ok.version))
            # The very signature verified above (not whatever the pending file holds by now);
            # with no manifest yet, a signature already there is an orphan of a crash.
            sig_path = self.root / signature_key(ok.name, ok.version)
            write_bytes_atomic(sig_path, signature)
            self._place(body, final, same_if_exists=False)
            pending.unlink(missing_ok=True)
        return 201

    def _upstream_base(self, authority: Authority, manifest: Manifest) -> SignedRelease | None:
        """The upstream release ``manifest`` names as its base, read from this folder and
        verified as one; None when it names none or it is not here. 403 when what is there
        is not an upstream release (a device's version, an untrusted or scoped-out key)."""
        if manifest.base is None:
            return None
        name, version = manifest.name, manifest.base.version
        try:
            data = (self.root / manifest_key(name, version)).read_bytes()
            signature = (self.root / signature_key(name, version)).read_bytes()
        except FileNotFoundError:
            return None
        where = f"{name}@{version} (the base of {manifest.ref})"
        with self._verifying:
            try:
                return verify_release(data, signature, authority.keys, where)
            except LineageError as e:
                raise Refused(403, str(e)) from None
            except RefusedError as e:  # its own message may name the server's files
                raise Refused(403, f"{where} does not verify as an upstream release signed by "
                                   f"a key this registry trusts ({type(e).__name__})") from None

    def highest_sequence(self, name: str) -> int:
        """The model's counter; if it is missing or unreadable, the highest sequence of the
        manifests stored (read under the model lock, so it only grows)."""
        try:
            value = loads_strict((self.root / sequence_key(name)).read_bytes(), "counter")
            if isinstance(value, dict) and isinstance(value.get("sequence"), int):
                return int(value["sequence"])
        except (OSError, MalformedJsonError):
            pass
        best = 0
        folder = self.root / name
        for m in folder.glob("*/manifest.json") if folder.is_dir() else []:
            seq = _sequence_of(m)
            best = max(best, seq or 0)
        return best

    @contextmanager
    def _model_lock(self, name: str) -> Iterator[None]:
        # flock on a file opened per call: excludes other threads and other server processes.
        with open(self.state / "locks" / f"{name}.lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- the counter

    def _sequence(self, ok: ObjectKey, body: Path) -> int:
        try:
            doc = loads_strict(body.read_bytes(), ok.key, max_bytes=MAX_SEQUENCE_BYTES)
            seq, version = doc["sequence"], check_version(doc["version"])
        except (MalformedJsonError, KeyError, TypeError, ValueError) as e:
            why = f"{ok.key}: expected {{'sequence': N, 'version': V}} ({e})"
            raise Refused(400, why) from None
        m = self.path(ObjectKey("manifest", manifest_key(ok.name, version)))
        if m.is_file() and _sequence_of(m) == seq:
            return 200  # what the commit already recorded: nothing to write
        raise Refused(409, f"{ok.key}: the server keeps this counter; {ok.name}@{version} with "
                           f"sequence {seq} is not a committed version")

    # -- placing files

    def _place(self, body: Path, final: Path, *, same_if_exists: bool) -> int:
        """Link the finished body into place; never replaces what is there."""
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(body, "rb") as f:
            os.fsync(f.fileno())
        try:
            os.link(body, final)
        except FileExistsError:
            if same_if_exists:
                return 200
            raise Refused(409, f"{final.relative_to(self.root)} exists; objects are never "
                               "overwritten") from None
        finally:
            body.unlink(missing_ok=True)
        fsync_dir(final.parent)
        return 201

    def _same(self, final: Path, data: bytes, ok: ObjectKey) -> int:
        try:
            if final.read_bytes() == data:
                return 200
        except FileNotFoundError:
            pass
        raise Refused(409, f"{ok.key} exists; versions are immutable, pick a new one")


def _counter(sequence: int, version: str) -> bytes:
    # The very bytes registry.publish writes, so the publisher's own write is a no-op.
    return json.dumps({"sequence": sequence, "version": version}).encode()


def _sequence_of(manifest: Path) -> int | None:
    try:
        doc = loads_strict(manifest.read_bytes(), str(manifest), max_bytes=MAX_MANIFEST_BYTES)
    except (OSError, MalformedJsonError):
        return None
    seq = doc.get("sequence") if isinstance(doc, dict) else None
    return seq if isinstance(seq, int) else None
