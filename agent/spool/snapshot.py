"""A spool snapshot on disk: one .npz a fine-tune trains on (``hpc_core.data`` reads x and
y), written so that the same samples always give the same bytes and so the same sha256."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from registry.atomic import atomic_output


class SnapshotInfo(BaseModel):
    """A spool snapshot: an .npz with x (N, C, H, W float32), y (N int64) and pseudo (N bool)."""

    model_config = ConfigDict(extra="forbid")

    path: Path
    sha256: str
    """Of the .npz file; the same samples always give the same file."""
    samples: int
    per_class: dict[int, int]
    pseudo_labelled: int
    sample_shape: tuple[int, int, int] | None


def write_snapshot(out: Path, x: np.ndarray, y: np.ndarray, pseudo: np.ndarray) -> SnapshotInfo:
    """Write the .npz atomically and describe it."""
    with atomic_output(out) as tmp:
        write_npz(tmp, {"x": x, "y": y, "pseudo": pseudo})
    return SnapshotInfo(path=out, sha256=file_sha256(out), samples=len(y),
                        per_class=class_counts(y), pseudo_labelled=int(pseudo.sum()),
                        sample_shape=tuple(x.shape[1:]) if len(y) else None)


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez's layout with fixed member times, so equal arrays give equal bytes whenever
    they are written."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with z.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def class_counts(y: np.ndarray) -> dict[int, int]:
    values, counts = np.unique(y, return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts, strict=True)}
