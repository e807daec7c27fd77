"""Registry credentials on the client: one bearer token, bound to one registry's origin.

A token is sent only to the origin (scheme, host, port) of the registry it was configured
for, only over https (plain http only to a loopback address: tests and the demo), and only on
requests that need it: every PUT, and GET/HEAD only once that server has answered 401.
A redirect to another origin, or a command naming another registry, never sees it.

Configuration gives the token either as a file (:func:`read_token_file`, mode 0600: what a
device's config names) or, for command lines, as ``$EDGETRAIN_REGISTRY_TOKEN``, which is bound
to the registry in ``$EDGETRAIN_REGISTRY`` and to no other.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError, field_validator

from registry.errors import KeyFileError

TOKEN_ENV = "EDGETRAIN_REGISTRY_TOKEN"
"""A principal's registry token, sent only to the registry named by ``REGISTRY_ENV``."""
REGISTRY_ENV = "EDGETRAIN_REGISTRY"
"""The registry the command line tools use by default, and the one ``TOKEN_ENV`` is for."""
MAX_TOKEN_CHARS = 256

Origin = tuple[str, str, int]


def origin_of(url: str) -> Origin:
    """(scheme, host, port) with the scheme's default port filled in; ValueError if not
    http(s)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.scheme, parsed.hostname.lower(), port


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (all of 127.0.0.0/8, ``::1``, bracketed or not): the one
    check every listener of the project makes before it serves without authentication, and
    every client before it sends a token over plain HTTP. Any other name is not loopback: it
    may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_token(token: str, where: str) -> str:
    """Printable ASCII without spaces: what fits an Authorization header unchanged."""
    if not token or len(token) > MAX_TOKEN_CHARS or not all(33 <= ord(c) < 127 for c in token):
        raise KeyFileError(
            f"{where}: a registry token is 1-{MAX_TOKEN_CHARS} printable ASCII characters "
            "without spaces (mint one with `python -m registry.serve add-principal`)"
        )
    return token


class RegistryCredential(BaseModel):
    """A bearer token for exactly one registry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    registry: str
    """The registry URL the token belongs to; only its origin matters."""
    token: SecretStr
    """The principal's token (the server keeps only its sha256)."""

    @field_validator("registry")
    @classmethod
    def _safe_transport(cls, v: str) -> str:
        scheme, host, _ = origin_of(v)
        if scheme == "http" and not is_loopback(host):
            raise ValueError(
                f"{v}: a registry token travels only over https (plain http only to a loopback "
                "address); give the registry's https:// URL"
            )
        return v

    @property
    def origin(self) -> Origin:
        return origin_of(self.registry)

    def header_for(self, url: str) -> dict[str, str]:
        """The Authorization header for a request to ``url``: empty unless it is this
        registry's origin."""
        try:
            if origin_of(url) != self.origin:
                return {}
        except ValueError:
            return {}
        return {"Authorization": f"Bearer {self.token.get_secret_value()}"}


def read_token_file(path: Path) -> str:
    """The token in ``path`` (one line); refused if others may read or write the file."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read registry token {path}: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"registry token {path} is open to other users (mode {stat.S_IMODE(mode):o}): run "
            f"`chmod 600 {path}`"
        )
    return check_token(text, str(path))


def credential_from_env(environ: Mapping[str, str] | None = None) -> RegistryCredential | None:
    """``$EDGETRAIN_REGISTRY_TOKEN`` bound to ``$EDGETRAIN_REGISTRY``; None when either is unset
    or the registry is not http(s) (a folder or S3 has no use for it)."""
    env = os.environ if environ is None else environ
    token, registry = env.get(TOKEN_ENV), env.get(REGISTRY_ENV)
    if not token or not registry or urlparse(registry).scheme not in ("http", "https"):
        return None
    try:
        return RegistryCredential(registry=registry, token=check_token(token, f"${TOKEN_ENV}"))
    except ValidationError as e:
        raise KeyFileError(f"${REGISTRY_ENV}: {e.errors()[0]['msg']}") from None
