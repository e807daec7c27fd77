"""What every registry store offers: whole-object reads and writes, and ranged streams.

``deadline`` bounds a request's wall time where the transport can enforce it (HTTP); the
folder store answers at disk speed, and S3 relies on botocore's own timeouts.
"""

from __future__ import annotations

from typing import Protocol

from registry.errors import StoreError
from registry.transfer import Deadline


def safe_key(key: str) -> str:
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"registry key {key!r} is not a plain relative path")
    return key


class RangeReader(Protocol):
    size: int
    """Total size of the object (not of the remaining range)."""

    def readinto(self, buf: memoryview) -> int: ...

    def close(self) -> None: ...


class RegistryStore(Protocol):
    uri: str

    def exists(self, key: str, deadline: Deadline | None = None) -> bool: ...

    def get(self, key: str, max_bytes: int, deadline: Deadline | None = None) -> bytes | None:
        """The whole object, or None when it does not exist."""

    def put(self, key: str, data: bytes, deadline: Deadline | None = None) -> None:
        """Write an object atomically: readers see all of it or nothing."""

    def open_range(self, key: str, start: int, deadline: Deadline | None = None) -> RangeReader:
        """Stream the object from byte ``start`` to its end; reads stop at ``deadline``."""

    def close(self) -> None:
        """Drop pooled connections (the store stays usable)."""
