"""Names a registry accepts, and where objects live in it.

Model names, versions, tensor names and artefact paths all end up in file-system paths on the
device, so each is checked against a narrow pattern before anything uses it.
"""

from __future__ import annotations

import re

from registry.errors import UnsafeNameError

CHUNK_PREFIX = "chunks/sha256"

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MAX_VERSION_CHARS = 64
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_TENSOR_PART_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_PATH_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _unsafe(kind: str, value: str, why: str) -> UnsafeNameError:
    return UnsafeNameError(f"{kind} {value!r} is refused: {why}")


def check_tensor_name(name: str) -> str:
    """State-dict keys: dot-separated identifiers. Nothing that reads as a path survives."""
    if not name or len(name) > 512:
        raise _unsafe("tensor name", name, "must be 1-512 characters")
    if name == "__metadata__":
        raise _unsafe("tensor name", name, "reserved by the safetensors header")
    if any(not _TENSOR_PART_RE.match(part) for part in name.split(".")):
        raise _unsafe(
            "tensor name", name,
            "each dot-separated part must be letters, digits, '_' or '-' ('..', '/', absolute "
            "paths would escape the slot)",
        )
    return name


def check_artefact_path(path: str) -> str:
    """A relative POSIX path inside the slot's artefacts/ folder; no '..', no hidden files."""
    if not path or len(path) > 255 or path.startswith("/") or "\\" in path:
        raise _unsafe("artefact path", path, "must be a relative POSIX path of 1-255 characters")
    parts = path.split("/")
    if len(parts) > 8 or any(not _PATH_PART_RE.match(p) for p in parts):
        raise _unsafe(
            "artefact path", path,
            "each part must start with a letter, digit or '_' and use only [A-Za-z0-9_.-] "
            "(at most 8 parts); '..' and absolute paths would escape the slot",
        )
    return path


def check_model_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"model name {name!r} is invalid: use 1-64 of [a-z0-9._-], starting with a "
            "letter or digit"
        )
    return name


def check_version(version: str) -> str:
    if not _VERSION_RE.match(version):
        raise ValueError(
            f"version {version!r} is invalid: use 1-64 of [A-Za-z0-9._+-], starting with a letter "
            "or digit (no '/')"
        )
    return version


def check_sha256(value: str) -> str:
    if not _SHA256_RE.match(value):
        raise ValueError("must be 64 lower-case hex digits")
    return value


def chunk_key(sha256: str) -> str:
    """Where a chunk lives in a registry (two-hex fan-out keeps directories small)."""
    return f"{CHUNK_PREFIX}/{sha256[:2]}/{sha256}"


def manifest_key(name: str, version: str) -> str:
    return f"{name}/{version}/manifest.json"


def signature_key(name: str, version: str) -> str:
    return f"{name}/{version}/manifest.sig"


def sequence_key(name: str) -> str:
    """The highest sequence published for a model (a publisher's counter, not trusted data)."""
    return f"{name}/_sequence.json"  # "_" starts no version: never clashes with one
