"""A registry in a local (or mounted) folder: what a static HTTP server or a CDN serves.

Its objects are written 0644 in 0755 folders (registry.atomic: the public kinds): a static
server runs as an account of its own, and they are signed, content-addressed and served to
any device by default. Folders above the registry's root that a publish makes are 0700."""

from __future__ import annotations

import os
from pathlib import Path

from registry.atomic import PUBLIC_DIR_MODE, PUBLIC_FILE_MODE, make_dirs, write_bytes_atomic
from registry.errors import RefError, StoreError, StoreNotFoundError, StoreTransientError
from registry.names import check_model_name, check_version
from registry.stores.base import RangeReader, safe_key
from registry.transfer import Deadline


class _FileRange:
    def __init__(self, path: Path, start: int) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - handed to the caller, closed by close()
        self.size = os.fstat(self._f.fileno()).st_size
        self._f.seek(start)

    def readinto(self, buf: memoryview) -> int:
        return self._f.readinto(buf)

    def close(self) -> None:
        self._f.close()


class LocalStore:
    """A registry in a local (or mounted) folder."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.uri = self.root.resolve().as_uri()

    def path(self, key: str) -> Path:
        return self.root / safe_key(key)

    def exists(self, key: str, deadline: Deadline | None = None) -> bool:
        return self.path(key).is_file()

    def get(self, key: str, max_bytes: int, deadline: Deadline | None = None) -> bytes | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                data = f.read(max_bytes + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {p}: {e.strerror}") from None
        if len(data) > max_bytes:
            raise StoreError(f"{p} is over the {max_bytes}-byte limit for this object")
        return data

    def put(self, key: str, data: bytes, deadline: Deadline | None = None) -> None:
        dest = self.path(key)
        if not dest.parent.is_dir():
            make_dirs(self.root.parent)
            make_dirs(dest.parent, PUBLIC_DIR_MODE)
        write_bytes_atomic(dest, data, PUBLIC_FILE_MODE)

    def close(self) -> None:
        pass

    def list_versions(self, name: str) -> list[str]:
        """The versions of model ``name`` that have a manifest, sorted as strings ([] for an
        unknown model). Only a folder store lists: HTTP (``registry.serve`` or a static server)
        and S3 are read by key, so a caller names the versions it wants there."""
        try:
            folder = self.path(check_model_name(name))
        except ValueError as e:
            raise RefError(str(e)) from None
        try:
            entries = list(folder.iterdir())
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"cannot list {folder}: {e.strerror}") from None
        out = []
        for entry in entries:
            try:
                check_version(entry.name)
            except ValueError:
                continue  # _sequence.json and anything else that is not a version
            if (entry / "manifest.json").is_file():
                out.append(entry.name)
        return sorted(out)

    def open_range(self, key: str, start: int, deadline: Deadline | None = None) -> RangeReader:
        try:
            return _FileRange(self.path(key), start)
        except FileNotFoundError:
            raise StoreNotFoundError(f"{self.path(key)} does not exist") from None
        except OSError as e:
            raise StoreTransientError(f"cannot read {self.path(key)}: {e.strerror}") from None
