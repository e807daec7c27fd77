"""Files the exporters write: each appears whole or not at all (temp + fsync + rename).

A device can lose power mid-export; the agent installs what it finds in the output folder,
so a half-written model file must never carry the final name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from hpc_core.atomic import fsync_dir, write_json_atomic

__all__ = ["atomic_output", "file_mb", "write_json_atomic"]


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For tools that insist on writing to a path themselves (``torch.onnx.export``,
    ``quantize_static``, TensorRT's serializer).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Keep the suffix: some writers pick the format from it.
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def file_mb(path: Path) -> float:
    return Path(path).stat().st_size / 1e6
