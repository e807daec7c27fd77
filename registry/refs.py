"""Model references: ``NAME@VERSION`` against a registry, or a full URL to one version."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from registry.errors import RefError
from registry.names import check_model_name, check_version


@dataclass(frozen=True)
class Ref:
    name: str
    version: str
    registry: str
    """Registry root: http(s)://…, file://…, s3://… or a folder."""

    def __str__(self) -> str:
        return f"{self.name}@{self.version} from {self.registry}"


def parse_ref(ref: str, registry: str | None = None) -> Ref:
    """``name@version`` (needs ``registry``) or a full URL to a version folder / manifest.json:
    ``https://host/reg/name/version[/manifest.json]``, ``file:///srv/reg/name/version``,
    ``s3://bucket/prefix/name/version``."""
    if "://" not in ref:
        name, sep, version = ref.partition("@")
        if not sep:
            raise RefError(f"{ref!r}: give a version, as NAME@VERSION (e.g. digits-cnn@3)")
        if not registry:
            raise RefError(
                f"{ref!r} needs a registry: pass --registry URL or set EDGETRAIN_REGISTRY, or give "
                "a full URL like https://host/registry/NAME/VERSION"
            )
        return _checked(name, version, registry.rstrip("/"))
    parsed = urlparse(ref)
    if parsed.scheme not in ("http", "https", "file", "s3"):
        raise RefError(f"{ref!r}: unsupported scheme {parsed.scheme!r} (http, https, file, s3)")
    path = parsed.path.rstrip("/")
    if path.endswith("/manifest.json"):
        path = path[: -len("/manifest.json")]
    parts = path.split("/")
    if len(parts) < 3 or not parts[-1] or not parts[-2]:
        raise RefError(f"{ref!r}: expected …/REGISTRY/NAME/VERSION[/manifest.json]")
    root = parsed._replace(path="/".join(parts[:-2]), params="", query="", fragment="").geturl()
    if parsed.scheme == "file" and not root.startswith("file:///"):
        root = "file://" + "/".join(parts[:-2])
    return _checked(unquote(parts[-2]), unquote(parts[-1]), root)


def _checked(name: str, version: str, registry: str) -> Ref:
    try:
        check_model_name(name)
        check_version(version)
    except ValueError as e:
        raise RefError(str(e)) from None
    return Ref(name, version, registry)
