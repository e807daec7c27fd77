"""What the device trusts, checked on disk before it is used: the trusted-keys folder and the
files that hold its secrets.

``registry.signing.load_trusted_keys`` reads whatever ``*.pub.pem`` it finds; on a device the
folder is a trust root, so before it is read this module makes sure nobody but root or the
service user could have put anything there, and that each key file is exactly one PEM public
key (a file with a PEM block somewhere inside it — a log, a database, a URL with a key in its
query string — is not a key file). Secrets (broker password, TLS key, signing key, registry
token) must be unreadable to anyone else. Every refusal names the file and the fix.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from registry.errors import KeyFileError

PUBLIC_SUFFIX = ".pub.pem"
SCOPE_SUFFIX = ".scope"
MAX_KEY_FILE_BYTES = 4096
"""An Ed25519 public key in PEM is 113 bytes; a scope file is a few patterns."""

_ONE_PUBLIC_KEY = re.compile(
    rb"\s*-----BEGIN PUBLIC KEY-----\r?\n[A-Za-z0-9+/=\r\n]+-----END PUBLIC KEY-----\s*"
)


def default_trusted_keys(state_dir: Path) -> Path:
    """The trusted-keys folder of a device whose config (``registry.trusted_keys``) or
    command line (``--trusted-keys``) names none: ``STATE_DIR/trusted_keys``."""
    return state_dir / "trusted_keys"


def _owners() -> set[int]:
    """root and the user this process runs as (the service user under systemd)."""
    return {0, os.geteuid()}


def _check_owner_and_mode(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_uid not in _owners():
        raise KeyFileError(
            f"{what} {path} is owned by uid {st.st_uid}: only root or the service user (uid "
            f"{os.geteuid()}) may own it; chown it or remove it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyFileError(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"run `chmod go-w {path}`"
        )


def check_trusted_dir(where: Path) -> list[Path]:
    """The key files of a trusted-keys folder, each checked; KeyFileError naming the first
    thing that is not as it must be. The folder: a directory owned by root or the service
    user, not group/world-writable, holding only ``NAME.pub.pem`` (exactly one PEM public key
    each) and ``NAME.scope`` files, regular files (no links) owned and protected the same way."""
    where = Path(where)
    try:
        st = os.stat(where)
    except OSError as e:
        raise KeyFileError(
            f"trusted keys {where}: {e.strerror}: copy the publisher's *{PUBLIC_SUFFIX} into "
            "that folder"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise KeyFileError(
            f"trusted keys {where} is not a folder: it must be a folder of *{PUBLIC_SUFFIX} files"
        )
    _check_owner_and_mode(where, st, "trusted-keys folder")
    keys = []
    for entry in sorted(where.iterdir()):
        if not entry.name.endswith((PUBLIC_SUFFIX, SCOPE_SUFFIX)):
            raise KeyFileError(
                f"{entry} does not belong in the trusted-keys folder (only NAME{PUBLIC_SUFFIX} "
                f"and NAME{SCOPE_SUFFIX}): move it elsewhere"
            )
        est = os.lstat(entry)
        if not stat.S_ISREG(est.st_mode):
            raise KeyFileError(f"trusted key file {entry} is not a regular file (a link or a "
                               "folder): put the file itself there")
        _check_owner_and_mode(entry, est, "trusted key file")
        if est.st_size > MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"trusted key file {entry} is {est.st_size} bytes: a key or "
                               f"scope file is under {MAX_KEY_FILE_BYTES}")
        if entry.name.endswith(PUBLIC_SUFFIX):
            if not _ONE_PUBLIC_KEY.fullmatch(entry.read_bytes()):
                raise KeyFileError(
                    f"{entry} is not exactly one PEM public key (one BEGIN/END PUBLIC KEY "
                    "block and nothing else)"
                )
            keys.append(entry)
    if not keys:
        raise KeyFileError(
            f"no *{PUBLIC_SUFFIX} public keys in {where}: copy the publisher's public key there"
        )
    return keys


def load_trusted(where: Path) -> dict[str, Any]:
    """:func:`check_trusted_dir`, then ``registry.signing.load_trusted_keys`` on that folder:
    the only way the device loads what it trusts."""
    from registry.signing import load_trusted_keys

    check_trusted_dir(where)
    return load_trusted_keys(where)


def check_trusted_file(path: Path, what: str) -> None:
    """A single trust root that is not secret (the broker's CA bundle): owned by root or the
    service user and writable by nobody else. KeyFileError naming the path otherwise."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise KeyFileError(f"{what} {path}: {e.strerror}") from None
    _check_owner_and_mode(path, st, what)


def check_secret_file(path: Path, what: str) -> None:
    """A credential or private key: a regular file nobody but its owner may read or write.
    KeyFileError naming the path otherwise."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise KeyFileError(f"{what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{what} {path} is not a regular file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"{what} {path} is open to group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"run `chmod 600 {path}` (owned by the service user)"
        )
