"""Registry stores behind one factory: a folder, HTTP(S), or S3-compatible storage."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from registry.credentials import RegistryCredential
from registry.errors import RefError
from registry.stores.base import RangeReader, RegistryStore
from registry.stores.folder import LocalStore
from registry.stores.http import HttpStore
from registry.transfer import TransferConfig

__all__ = ["HttpStore", "LocalStore", "RangeReader", "RegistryStore", "open_store"]


def open_store(uri: str | Path, cfg: TransferConfig | None = None,
               credential: RegistryCredential | None = None) -> RegistryStore:
    """A registry location: a folder path, ``file://``, ``http(s)://`` or ``s3://bucket/prefix``.

    ``cfg`` sets timeouts and pooling for HTTP; folder and S3 stores do not need it.
    ``credential`` is the configured registry's token: HTTP sends it to that origin only.
    """
    text = str(uri)
    parsed = urlparse(text)
    if parsed.scheme in ("http", "https"):
        return HttpStore(text, cfg, credential)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise RefError(f"{text}: an S3 registry is s3://BUCKET/PREFIX")
        from registry.stores.s3 import S3Store  # boto3 is an optional extra

        return S3Store(parsed.netloc, parsed.path)
    if parsed.scheme == "file":
        return LocalStore(Path(unquote(parsed.path)))
    if parsed.scheme and len(parsed.scheme) > 1:  # 'C:' style drive letters are paths
        raise RefError(
            f"{text}: unsupported registry scheme {parsed.scheme!r} (a folder, file://, http://, "
            "https:// or s3://)"
        )
    return LocalStore(Path(text))
