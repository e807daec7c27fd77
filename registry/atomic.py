"""Crash-safe file writes: temp file + fsync + rename, then fsync the directory.

The storage layer's own primitive (a registry folder, a device slot, a checkpoint all rely on
it); every package imports it from here. Torch-free on purpose: the device's sync and slot code
use it without importing torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_path(path: Path) -> Path:
    """A temporary name beside ``path``, unique per call: threads of one process (the registry
    server's PUT handlers) may write the same file at once. The suffix stays: some writers
    pick the format from it."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")


def remove_stale_temps(folder: Path, *, recursive: bool = False) -> list[Path]:
    """Delete the temporary files (:func:`_tmp_path`) that a writer killed mid-write left in
    ``folder``; a file whose writer process is still alive is kept. Returns what was removed.
    Run where a killed writer's successor starts (the job worker, the daemon)."""
    removed = []
    pattern = f"{TMP_PREFIX}*"
    for p in (folder.rglob(pattern) if recursive else folder.glob(pattern)):
        pid_text = p.name[len(TMP_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or p.is_symlink() or not p.is_file():
            continue
        pid = int(pid_text)
        if pid != os.getpid() and _alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def write_json_atomic(path: Path, obj: Any) -> None:
    """Readers see the old file or the new one, never half of either."""
    write_bytes_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Same guarantee as write_json_atomic for text and binary files (YAML, Markdown, PNG)."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the write or the rename failed
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For tools that insist on writing to a path themselves (``torch.onnx.export``,
    ``quantize_static``, TensorRT's serializer). On an exception the temporary file goes and
    the old ``path``, if any, stays: a device that loses power mid-export installs what it
    finds, so a half-written model must never carry the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
