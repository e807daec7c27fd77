"""File-system access under the state directory that never follows a symbolic link (CWE-59).

Whoever can write into the state directory could plant ``chunks/sha256/ab -> /etc`` or
``lock -> /root/.bashrc`` and have the agent (often root) write or delete through it. Every
folder below the state root is checked with ``lstat`` before use, every file is opened with
``O_NOFOLLOW``; a link where a real entry belongs is refused with :class:`UnsafeStateError`.
The state root itself may be a link (``/var/lib/edge-agent -> /data/edgetrain`` is a normal
set-up): only what the agent creates below it is checked.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from registry.atomic import PRIVATE_DIR_MODE, set_dir_mode
from registry.errors import UnsafeStateError


def _refuse(path: Path, what: str) -> UnsafeStateError:
    return UnsafeStateError(
        f"{path} is {what} where the agent keeps a real folder or file; refusing to follow "
        "it (someone planted it, or the state dir was copied with links): remove it and retry"
    )


def real_dir(path: Path, *, create: bool = True) -> Path:
    """``path`` as a real directory (made if missing and ``create``); a link is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return path
        try:
            os.mkdir(path, PRIVATE_DIR_MODE)
            set_dir_mode(path)  # exactly 0700: mkdir's mode is masked by the umask
        except FileExistsError:  # another thread made it: check what it is
            pass
        except FileNotFoundError:
            real_dir(path.parent)
            os.mkdir(path, PRIVATE_DIR_MODE)
            set_dir_mode(path)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "not a directory")
    return path


def real_dirs(root: Path, *parts: str, create: bool = True) -> Path:
    """``root/parts...``, each level checked (and made) as a real directory."""
    path = Path(root)
    for part in parts:
        path = real_dir(path / part, create=create)
    return path


def is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def open_fd(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` with O_NOFOLLOW; a link at ``path`` raises UnsafeStateError."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link") from None
        raise


def open_read(path: Path) -> BinaryIO:
    return os.fdopen(open_fd(path, os.O_RDONLY), "rb")


def open_append(path: Path) -> BinaryIO:
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")


def open_new(path: Path) -> BinaryIO:
    """A new file for writing; an entry already at ``path`` (a link above all) is an error."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")


def read_bytes(path: Path, limit: int | None = None) -> bytes:
    with open_read(path) as f:
        return f.read() if limit is None else f.read(limit)


def regular_file(path: Path) -> bool:
    """True for a regular file (never through a link); False if missing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "a symbolic link")
    return stat.S_ISREG(st.st_mode)
