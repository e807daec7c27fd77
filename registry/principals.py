"""Who may write to a registry served by ``registry.serve``: one bearer token per principal.

A principal is an upstream publisher or one device. The server's principals file lists each
with the signing keys it owns (names of ``*.pub.pem`` files in the server's trusted-keys
folder) and the sha256 of its token; the token itself is never on the server's disk::

    principals:
      - name: upstream
        kind: upstream
        keys: [upstream]
        token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
      - name: jetson-07
        kind: device
        device_id: jetson-07
        keys: [jetson-07]
        token_sha256: ...

``python -m registry.serve add-principal`` mints a token, writes it (0600) where the principal
will read it and appends the entry. Why bearer tokens and not mutual TLS here: this server is
the lab and single-site registry, run from a Python standard library HTTP server that also
serves plain http on loopback; a token needs no CA, works through any proxy and is revoked by
deleting one line. In production, terminate TLS at a reverse proxy (nginx, Envoy) and require
client certificates there (CN = principal name), which also keeps the token off the wire.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from registry.atomic import write_bytes_atomic
from registry.errors import KeyFileError
from registry.signing import PUBLIC_SUFFIX, TrustedKey, load_trusted_keys

log = logging.getLogger("registry.serve")

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def hash_token(token: bytes | str) -> str:
    """sha256 hex of the token's bytes: what the principals file stores."""
    raw = token.encode("latin-1") if isinstance(token, str) else token
    return hashlib.sha256(raw).hexdigest()


def mint_token() -> str:
    """256 random bits, URL-safe: unguessable, so a plain sha256 suffices on the server (no
    salt or slow hash: there is no dictionary to protect against)."""
    return secrets.token_urlsafe(32)


class Principal(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """Who this is, as logs and errors name it: 'upstream', a device id."""
    kind: Literal["upstream", "device"]
    """upstream: publishes any version its keys' scopes cover; device: only its own
    ``NAME@*+DEVICE_ID.*`` versions."""
    device_id: str | None = None
    """The device's id (kind device only): its versions are ``PARENT+DEVICE_ID.STAMP``."""
    keys: tuple[str, ...] = Field(min_length=1)
    """Names of the trusted keys (``NAME.pub.pem`` in the server's trusted-keys folder) this
    principal signs with; a manifest it uploads must verify against one of them."""
    token_sha256: str
    """sha256 (64 lower-case hex digits) of the principal's bearer token."""

    @field_validator("name", "device_id")
    @classmethod
    def _id(cls, v: str | None) -> str | None:
        if v is not None and not _ID_RE.match(v):
            raise ValueError(f"{v!r}: use 1-64 of A-Z a-z 0-9 . _ -, starting with a letter "
                             "or digit")
        return v

    @field_validator("token_sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("must be the sha256 of the token, 64 lower-case hex digits (never "
                             "the token itself)")
        return v

    @model_validator(mode="after")
    def _device(self) -> Principal:
        if (self.kind == "device") != (self.device_id is not None):
            raise ValueError(f"principal {self.name}: device_id is required for kind device "
                             "and not allowed for kind upstream")
        return self


class PrincipalsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    principals: list[Principal] = Field(default_factory=list)
    """Everyone who may write; anyone else is refused with 401."""

    @model_validator(mode="after")
    def _unique(self) -> PrincipalsFile:
        for field in ("name", "token_sha256"):
            seen: set[str] = set()
            for p in self.principals:
                value = getattr(p, field)
                if value in seen:
                    raise ValueError(f"two principals share the {field} {value[:16]}: each "
                                     "principal needs its own")
                seen.add(value)
        owners: dict[str, str] = {}
        for p in self.principals:
            for k in p.keys:
                if k in owners and owners[k] != p.name:
                    raise ValueError(f"key {k} is listed for both {owners[k]} and {p.name}: a "
                                     "key has one owner")
                owners[k] = p.name
        return self


def read_principals(path: Path) -> PrincipalsFile:
    """The principals file (YAML or JSON); refused if others may write it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise KeyFileError(f"cannot read principals file {path}: {e}") from None
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyFileError(f"principals file {path} is writable by others: run "
                           f"`chmod go-w {path}`")
    try:
        return PrincipalsFile.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "top level"
        raise KeyFileError(f"{path}: {where}: {first['msg']}") from None


@dataclass(frozen=True)
class Authority:
    """The principals and the keys they own, checked against each other once at load."""

    principals: tuple[Principal, ...]
    keys: dict[str, TrustedKey]
    """Trusted keys by key id."""

    @classmethod
    def load(cls, principals_path: Path, keys: dict[str, TrustedKey]) -> Authority:
        doc = read_principals(principals_path)
        by_name = {k.name: k for k in keys.values()}
        for p in doc.principals:
            for k in p.keys:
                if k not in by_name:
                    raise KeyFileError(
                        f"{principals_path}: principal {p.name} owns key {k}, which is not in "
                        f"the trusted keys (add {k}{PUBLIC_SUFFIX} there)"
                    )
        return cls(tuple(doc.principals), keys)

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal whose token this ``Authorization: Bearer`` header carries, or None.

        Compares the token's hash with every entry's, always all of them, in constant time:
        neither the answer's timing nor an early exit tells which prefix was right.
        """
        if not authorization or authorization[:7].lower() != "bearer ":
            return None
        # Header values arrive decoded as latin-1: any byte sequence hashes, none crashes.
        presented = hash_token(authorization[7:].strip()).encode()
        found = None
        for p in self.principals:
            if hmac.compare_digest(presented, p.token_sha256.encode()):
                found = p
        return found

    def owner_of(self, key: TrustedKey) -> Principal | None:
        return next((p for p in self.principals if key.name in p.keys), None)

    def device_owning(self, version: str) -> Principal | None:
        """The device whose versions ``version`` belongs to: the text after its last '+' starts
        with ``DEVICE_ID.``; with device ids that prefix one another ('edge', 'edge.1') the
        longest wins, so no device can take a name from another's namespace."""
        _, plus, tail = version.rpartition("+")
        if not plus:
            return None
        devices = [p for p in self.principals if p.device_id is not None
                   and tail.startswith(f"{p.device_id}.")]
        return max(devices, key=lambda p: len(p.device_id or ""), default=None)


def add_principal(path: Path, *, name: str, kind: str, keys: list[str], token_out: Path,
                  device_id: str | None = None) -> Principal:
    """Mint a token into ``token_out`` (created 0600, never overwritten) and append the
    principal, with only the token's hash, to the principals file (created if missing)."""
    path, token_out = Path(path), Path(token_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Provisioning scripts add devices in parallel: one read-modify-write at a time.
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = read_principals(path) if path.exists() else PrincipalsFile()
        token = mint_token()
        try:
            entry = Principal(name=name, kind=kind, device_id=device_id,  # type: ignore[arg-type]
                              keys=tuple(keys), token_sha256=hash_token(token))
            updated = PrincipalsFile(principals=[*doc.principals, entry])
        except ValidationError as e:
            raise KeyFileError(f"{path}: {e.errors()[0]['msg']}") from None
        try:
            fd = _create_private(token_out)
        except FileExistsError:
            raise KeyFileError(f"{token_out} exists; tokens are never overwritten (pick another "
                               "path, or remove the old principal first)") from None
        with open(fd, "w") as f:
            f.write(token + "\n")
        body = yaml.safe_dump(updated.model_dump(mode="json", exclude_none=True),
                              sort_keys=False)
        # 0600 whatever the umask (write_bytes_atomic): the server refuses a file others may
        # edit, and token hashes are nobody else's business.
        write_bytes_atomic(path, ("# registry.serve principals: token hashes only\n"
                                  + body).encode())
    return entry


def _create_private(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)


class AuthoritySource:
    """The principals file and the trusted-keys folder, reloaded when either changes, so a
    device added (or revoked) while the server runs counts at once. A broken edit keeps the
    last good set and is logged; a broken file at start is an error."""

    def __init__(self, principals: Path, trusted_keys: Path, check_every_s: float = 1.0) -> None:
        self.principals, self.trusted_keys = Path(principals), Path(trusted_keys)
        self._check_every_s = check_every_s
        self._lock = threading.Lock()
        self._stamp = self._files_stamp()
        self._checked = time.monotonic()
        self._authority = self._load()

    def _load(self) -> Authority:
        return Authority.load(self.principals, load_trusted_keys(self.trusted_keys))

    def _files_stamp(self) -> tuple[tuple[str, int, int], ...]:
        files = [self.principals]
        if self.trusted_keys.is_dir():
            files += sorted(self.trusted_keys.iterdir())
        out = []
        for f in files:
            try:
                st = f.stat()
                out.append((f.name, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((f.name, -1, -1))
        return tuple(out)

    def current(self) -> Authority:
        with self._lock:
            now = time.monotonic()
            if now - self._checked < self._check_every_s:
                return self._authority
            self._checked = now
            stamp = self._files_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._authority = self._load()
                    log.warning("principals reloaded: %s",
                                ", ".join(p.name for p in self._authority.principals))
                except KeyFileError as e:
                    log.error("principals not reloaded, the previous set stays: %s", e)
            return self._authority
