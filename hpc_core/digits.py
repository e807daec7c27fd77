"""scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), read from the file
scikit-learn ships, without importing scikit-learn.

``import sklearn.datasets`` costs ~1 CPU-s (it brings ``scipy.stats`` and pandas with it): as
much as a small fine-tune's whole training, in every process that loads digits (an upstream
training's ranks, a trial, a tool that writes device data, a detector's synthetic scenes). The
data itself is one gzipped CSV inside the installed package, which ``load_digits`` reads with
``np.loadtxt``; reading it the same way gives the same arrays in ~20 ms. Where the file is not
where this release of scikit-learn keeps it, ``load_digits`` itself is the fallback.
"""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

N_DIGITS = 1797
"""Images in the set (scikit-learn's ``load_digits``: 1,797 8x8 images)."""
_CSV = ("datasets", "data", "digits.csv.gz")
"""The file inside the scikit-learn package: 64 pixel columns (0..16), then the label."""


def digits_csv() -> Path | None:
    """The bundled CSV, found without importing scikit-learn (``find_spec`` of a top-level
    package only searches ``sys.path``); None where it is not there."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root).joinpath(*_CSV)
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=1)
def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: (1797, 8, 8) float64 in 0..16 and (1797,) int64, equal to
    ``sklearn.datasets.load_digits()``'s ``images`` and ``target``. Cached per process; the
    arrays are read-only, so no caller can change another's copy."""
    path = digits_csv()
    if path is None:  # a scikit-learn that keeps its data elsewhere: ask it
        from sklearn.datasets import load_digits

        d = load_digits()
        images, labels = d.images, d.target
    else:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")
        images, labels = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    if images.shape != (N_DIGITS, 8, 8) or labels.shape != (N_DIGITS,):
        raise RuntimeError(f"scikit-learn's digits ({path or 'load_digits'}) hold "
                           f"{images.shape} images and {labels.shape} labels, not "
                           f"({N_DIGITS}, 8, 8) and ({N_DIGITS},): reinstall scikit-learn")
    images = np.ascontiguousarray(images, dtype=np.float64)
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels
