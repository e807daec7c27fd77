"""Ed25519 signatures over manifests; keys are PEM files.

Make a key pair with ``hpc-train keygen --out keys/ --name upstream``: it writes
``upstream.key.pem`` (PKCS#8 private key, mode 0600, stays with the publisher) and
``upstream.pub.pem`` (SubjectPublicKeyInfo, copied into every device's trusted-keys folder).
A device makes its own pair the same way to sign what it uploads, with ``--scope PATTERN``
(repeatable) writing its ``NAME.scope`` too.

A trusted key may carry a scope: ``NAME.scope`` beside ``NAME.pub.pem`` in the trusted-keys
folder, one pattern per line (``fnmatch`` syntax, ``#`` starts a comment). A pattern
``NAME`` matches every version of that model, ``NAME@VERSION`` one version; a device's key
gets e.g. ``digits-cnn@*+jetson-07.*`` (only its own uploads). A key without a scope file may
sign every model, as the upstream publisher's does.

Upstream releases and device versions: a key whose scope covers a whole model (a ``NAME``
pattern, or no scope file) is that model's publisher and may sign its upstream releases; a
key that covers only some of its versions (``NAME@VERSION`` patterns, a device's key) is
*device-scoped* for it, and every manifest it signs must name the upstream release its
lineage starts from (``base``): :func:`verify_signed_manifest` refuses one that names none,
and ``registry.lineage`` checks the base itself against an upstream key wherever a version is
accepted, so a device key can never mint an upstream release.

``manifest.sig`` is a small JSON document::

    {"format": "edgetrain.sig/1", "algorithm": "ed25519", "key_id": "<16 hex>",
     "signature": "<base64 of 64 bytes>"}

The signature covers a fixed domain prefix followed by the manifest's exact bytes, so a
signature made for something else can never pass as a manifest signature, and verification
never depends on re-serializing JSON.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import hashlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from registry.atomic import PRIVATE_FILE_MODE, PUBLIC_FILE_MODE, make_dirs, write_bytes_atomic
from registry.errors import (
    BadSignatureError,
    KeyFileError,
    KeyScopeError,
    LineageError,
    MalformedJsonError,
    UnknownKeyError,
    UnsignedManifestError,
)
from registry.jsonsafe import loads_strict
from registry.manifest import Manifest, Signer

SIG_FORMAT = "edgetrain.sig/1"
_DOMAIN = b"edgetrain.manifest/1\n"
MAX_SIGNATURE_BYTES = 4096
PRIVATE_SUFFIX = ".key.pem"
PUBLIC_SUFFIX = ".pub.pem"
SCOPE_SUFFIX = ".scope"
ALL_MODELS = ("*",)


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _stem(path: Path, suffix: str) -> str:
    return path.name[: -len(suffix)] if path.name.endswith(suffix) else path.stem


@dataclass(frozen=True)
class SigningKey:
    name: str
    key_id: str
    private: Ed25519PrivateKey

    @property
    def signer(self) -> Signer:
        return Signer(key_id=self.key_id, name=self.name)

    def sign_manifest(self, manifest_bytes: bytes) -> bytes:
        """The manifest.sig document for these exact manifest bytes."""
        sig = self.private.sign(_DOMAIN + manifest_bytes)
        doc = {
            "format": SIG_FORMAT,
            "algorithm": "ed25519",
            "key_id": self.key_id,
            "signature": base64.b64encode(sig).decode(),
        }
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class TrustedKey:
    name: str
    key_id: str
    public: Ed25519PublicKey
    path: Path
    scope: tuple[str, ...] = ALL_MODELS
    """Patterns of what this key may sign: ``NAME`` (any version) or ``NAME@VERSION``."""

    def may_release(self, name: str) -> bool:
        """Whether this key may sign upstream releases of model ``name``: its scope covers the
        whole model (no scope file, or a pattern without ``@`` matching ``name``). A key
        that covers ``name`` only through ``NAME@VERSION`` patterns is device-scoped: what it
        signs must descend from an upstream release (``registry.lineage``)."""
        return any("@" not in p and fnmatch.fnmatchcase(name, p) for p in self.scope)

    def may_sign(self, name: str, version: str) -> bool:
        """Whether this key's scope covers ``name@version``: a pattern ``NAME`` covers every
        version of the models it matches, ``NAME@VERSION`` only the versions it matches
        (fnmatch wildcards, case-sensitive)."""
        for pattern in self.scope:
            if "@" in pattern:
                if fnmatch.fnmatchcase(f"{name}@{version}", pattern):
                    return True
            elif fnmatch.fnmatchcase(name, pattern):
                return True
        return False


def check_scope_pattern(pattern: str) -> str:
    """One line of a ``NAME.scope`` file: a model name or ``NAME@VERSION``, fnmatch wildcards
    allowed; nothing that would read back as another pattern or a comment."""
    if not pattern or any(c.isspace() or c == "#" for c in pattern):
        raise KeyFileError(
            f"scope pattern {pattern!r} is invalid: one model name or NAME@VERSION per pattern, "
            "wildcards allowed, no spaces or '#' (e.g. 'digits-cnn' or 'digits-cnn@*+jetson-07.*')"
        )
    return pattern


def generate_keypair(out_dir: Path, name: str, scope: Sequence[str] = ()) -> tuple[Path, Path]:
    """Write ``{name}.key.pem`` (0600) and ``{name}.pub.pem``, and ``{name}.scope`` when
    ``scope`` names what the key may sign (0644: copied to devices, whose agent reads them as
    its own account); never overwrite a key or a scope. A missing ``out_dir`` is made 0700."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"key name {name!r} is invalid: use a plain file stem like 'upstream'")
    patterns = [check_scope_pattern(p) for p in scope]
    out_dir = make_dirs(Path(out_dir))
    priv_path, pub_path = out_dir / f"{name}{PRIVATE_SUFFIX}", out_dir / f"{name}{PUBLIC_SUFFIX}"
    scope_path = out_dir / f"{name}{SCOPE_SUFFIX}"
    for p in (priv_path, pub_path, *([scope_path] if patterns else [])):
        if p.exists():
            raise KeyFileError(f"{p} exists; keys are never overwritten (pick another --name)")
    private = Ed25519PrivateKey.generate()
    priv_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    # O_EXCL + 0600 at creation: the private key is never readable by others, not even briefly.
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), PRIVATE_FILE_MODE)  # exactly, whatever the umask
        f.write(priv_pem)
        f.flush()
        os.fsync(f.fileno())
    write_bytes_atomic(pub_path, pub_pem, PUBLIC_FILE_MODE)
    if patterns:
        header = f"# what {name}.pub.pem may sign: model names or NAME@VERSION patterns\n"
        write_bytes_atomic(scope_path, (header + "\n".join(patterns) + "\n").encode(),
                           PUBLIC_FILE_MODE)
    return priv_path, pub_path


def load_signing_key(path: Path) -> SigningKey:
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as e:
        raise KeyFileError(
            f"cannot read signing key {path}: {e.strerror} (make one with "
            "`hpc-train keygen --out DIR --name NAME`)"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"signing key {path} is readable by others: run `chmod 600 {path}`")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"{path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a {type(private).__name__}; only Ed25519 keys are used")
    return SigningKey(_stem(path, PRIVATE_SUFFIX), key_id(private.public_key()), private)


def read_scope(path: Path) -> tuple[str, ...]:
    """The patterns of a ``NAME.scope`` file; no file: every model."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return ALL_MODELS
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read key scope {path}: {e}") from None
    patterns = tuple(
        line.split("#", 1)[0].strip() for line in text.splitlines()
        if line.split("#", 1)[0].strip()
    )
    if not patterns:
        raise KeyFileError(
            f"{path} lists no pattern: write the model names this key may sign (e.g. "
            "'digits-cnn' or 'digits-cnn@*+jetson-07.*'), or delete it to allow every model"
        )
    return patterns


def load_public_key(path: Path) -> TrustedKey:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read public key {path}: {e.strerror}") from None
    if b"PRIVATE KEY" in data:
        raise KeyFileError(
            f"{path} holds a private key; a trusted-keys folder must hold only public keys "
            f"(*{PUBLIC_SUFFIX})"
        )
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"{path} is not a PEM public key: {e}") from None
    if not isinstance(public, Ed25519PublicKey):
        raise KeyFileError(f"{path} holds a {type(public).__name__}; only Ed25519 keys are used")
    name = _stem(path, PUBLIC_SUFFIX)
    scope = read_scope(path.with_name(f"{name}{SCOPE_SUFFIX}"))
    return TrustedKey(name, key_id(public), public, path, scope)


def load_trusted_keys(where: Path) -> dict[str, TrustedKey]:
    """Every ``*.pub.pem`` in a folder (private keys beside them are ignored), or one file."""
    where = Path(where)
    if where.is_file():
        files = [where]
    elif where.is_dir():
        files = sorted(p for p in where.iterdir() if p.name.endswith(PUBLIC_SUFFIX))
    else:
        raise KeyFileError(
            f"trusted keys {where} do not exist: copy the publisher's *{PUBLIC_SUFFIX} there"
        )
    keys = {k.key_id: k for k in map(load_public_key, files)}
    if not keys:
        raise KeyFileError(
            f"no *{PUBLIC_SUFFIX} public keys in {where}: copy the publisher's public key there"
        )
    return keys


def verify_signature(
    manifest_bytes: bytes, signature_bytes: bytes | None, trusted: dict[str, TrustedKey],
    source: str = "manifest",
) -> TrustedKey:
    """Return the trusted key that signed these exact bytes, or raise a SignatureError: the
    signature must be a :data:`SIG_FORMAT` document by a key in ``trusted`` over exactly
    ``manifest_bytes``. The bytes are not parsed here, nor the key's scope checked: what to
    install goes through :func:`verify_signed_manifest`, which does both."""
    if signature_bytes is None:
        raise UnsignedManifestError(f"{source} has no manifest.sig: unsigned versions are refused")
    try:
        doc = loads_strict(signature_bytes, "manifest.sig", max_bytes=MAX_SIGNATURE_BYTES)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc["format"] != SIG_FORMAT or doc["algorithm"] != "ed25519":
            raise ValueError(f"format {doc['format']!r}, algorithm {doc['algorithm']!r}")
        if not isinstance(doc["key_id"], str) or not isinstance(doc["signature"], str):
            raise ValueError("key_id and signature must be strings")
        kid, sig = doc["key_id"], base64.b64decode(doc["signature"], validate=True)
    except (MalformedJsonError, ValueError, KeyError, TypeError, binascii.Error) as e:
        raise UnsignedManifestError(
            f"{source}: manifest.sig is not an {SIG_FORMAT} document ({e})"
        ) from None
    key = trusted.get(kid)
    if key is None:
        raise UnknownKeyError(
            f"{source} is signed by key {kid}, which is not trusted here (trusted: "
            f"{', '.join(f'{k.name}={k.key_id}' for k in trusted.values())}); add the signer's "
            f"{PUBLIC_SUFFIX} to the trusted-keys folder if you trust it"
        )
    try:
        key.public.verify(sig, _DOMAIN + manifest_bytes)
    except InvalidSignature:
        raise BadSignatureError(
            f"{source}: signature by trusted key {key.name} ({kid}) does not match the manifest "
            "bytes: the manifest was altered after signing (or corrupted in transit)"
        ) from None
    return key


def verify_signed_manifest(
    manifest_bytes: bytes, signature_bytes: bytes | None, trusted: dict[str, TrustedKey],
    source: str = "manifest",
) -> tuple[Manifest, TrustedKey]:
    """Signature first, then the manifest, then the key's scope over the signed name@version,
    then the first half of the lineage rule: a device-scoped key's manifest must name an
    upstream ``base`` (LineageError otherwise). Whether that base is a real upstream release
    needs its signed manifest: ``registry.lineage.check_descends``, where it is at hand.

    Returns the manifest and the key that verified it: that key, not the ``signer`` the
    manifest names, is who vouches for the version.
    """
    key = verify_signature(manifest_bytes, signature_bytes, trusted, source)
    manifest = Manifest.from_bytes(manifest_bytes, source=source)
    if not key.may_sign(manifest.name, manifest.version):
        raise KeyScopeError(
            f"{source}: {manifest.ref} is signed by trusted key {key.name} ({key.key_id}), whose "
            f"scope {list(key.scope)} does not cover it (scope file: "
            f"{key.path.with_name(key.name + SCOPE_SUFFIX)})"
        )
    if manifest.base is None and not key.may_release(manifest.name):
        raise LineageError(
            f"{source}: {manifest.ref} is signed by {key.name} ({key.key_id}), a device-scoped "
            f"key (scope {list(key.scope)}), and names no upstream base: a device key can "
            "never make an upstream release; refused"
        )
    return manifest, key
