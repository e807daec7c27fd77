"""Crash-safe file writes: temp file + fsync + rename, then fsync the directory; and the
modes of what the project creates.

The storage layer's own primitive (a registry folder, a device slot, a checkpoint all rely on
it); every package imports it from here. Torch-free on purpose: the device's sync and slot code
use it without importing torch.

Modes: what a command creates is its user's alone, whatever umask the shell or the service
manager gave it. Files written here are 0600 and folders made by :func:`make_dirs` 0700, set
explicitly (``mkdir``'s and ``open``'s own modes are masked by the umask); each console
script's ``main`` runs under :func:`private_umask`, so what it or a library creates by other
means (SQLite's files, a log, a file torch or ONNX writes to a path) is private too. Two kinds
are meant for other accounts and are written 0644 (folders 0755) on purpose: public keys
(copied into devices' trusted-keys folders, read by the agent's own account) and the objects
of a folder registry (what any static HTTP server or CDN serves; signed, content-addressed).
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
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
PUBLIC_FILE_MODE = 0o644
"""Public keys and a folder registry's objects: meant to be read by other accounts."""
PUBLIC_DIR_MODE = 0o755
PRIVATE_UMASK = 0o077


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Run a command under umask 077 (restored after): what it, or a library it calls,
    creates without a mode of its own is its user's alone. Every console script's ``main``."""
    old = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def set_dir_mode(path: Path, mode: int = PRIVATE_DIR_MODE) -> None:
    """``mode`` on the folder ``path`` exactly (after ``os.mkdir``, whose mode the umask
    masks)."""
    # Through a descriptor opened without following links: a link put in the folder's place
    # since we made it is refused, never chmod-ed through.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_dirs(path: Path, mode: int = PRIVATE_DIR_MODE) -> Path:
    """``mkdir -p path``: each folder it creates gets ``mode`` exactly, whatever the umask;
    folders that were there are left as they are. Returns ``path``."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue  # another process made it meanwhile: its mode is its own
        set_dir_mode(d, mode)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")
    return path


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


def write_json_atomic(path: Path, obj: Any, mode: int = PRIVATE_FILE_MODE) -> None:
    """Readers see the old file or the new one, never half of either."""
    write_bytes_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode(), mode)


def write_bytes_atomic(path: Path, data: bytes, mode: int = PRIVATE_FILE_MODE) -> None:
    """Same guarantee as write_json_atomic for text and binary files (YAML, Markdown, PNG);
    the file is ``mode`` (0600 unless said otherwise) from its first byte, whatever the umask."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # the umask masked open's mode
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the write or the rename failed
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_output(path: Path, mode: int = PRIVATE_FILE_MODE) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it, set ``mode`` and rename it
    into place (its folder, if missing, made by :func:`make_dirs`).

    For tools that insist on writing to a path themselves (``torch.onnx.export``,
    ``quantize_static``, TensorRT's serializer). On an exception the temporary file goes and
    the old ``path``, if any, stays: a device that loses power mid-export installs what it
    finds, so a half-written model must never carry the final name.
    """
    path = Path(path)
    make_dirs(path.parent)
    tmp = _tmp_path(path)
    try:
        yield tmp
        os.chmod(tmp, mode)
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
