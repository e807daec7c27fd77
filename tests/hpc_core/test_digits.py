"""The bundled digits read without scikit-learn: the very arrays ``load_digits`` gives, and no
scikit-learn (nor the scipy.stats and pandas it brings) in a process that loads them."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hpc_core import digits
from tests.agent.jobs.conftest import REPO


def test_the_arrays_are_load_digits_own() -> None:
    from sklearn.datasets import load_digits

    images, labels = digits.digits_arrays()
    d = load_digits()
    assert images.dtype == d.images.dtype and labels.dtype == d.target.dtype
    np.testing.assert_array_equal(images, d.images)
    np.testing.assert_array_equal(labels, d.target)
    # Cached for the process, and read-only: no caller can change another's digits.
    assert digits.digits_arrays()[0] is images
    with pytest.raises(ValueError, match="read-only"):
        images[0, 0, 0] = 1.0


def test_loading_digits_imports_no_scikit_learn() -> None:
    code = ("import sys\n"
            "from hpc_core.data import load_digits_tensors\n"
            "from hpc_core.tasks.detection.synthetic import _digits_by_class\n"
            "x, y = load_digits_tensors(16)\n"
            "assert x.shape == (1797, 1, 16, 16) and int(y.max()) == 9, (x.shape, y.max())\n"
            "assert len(_digits_by_class()) == 10\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('sklearn', 'pandas') or m.startswith('scipy.stats'))\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_a_scikit_learn_without_the_file_is_asked_instead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sklearn.datasets import load_digits

    monkeypatch.setattr(digits, "digits_csv", lambda: None)
    digits.digits_arrays.cache_clear()
    try:
        images, labels = digits.digits_arrays()
        np.testing.assert_array_equal(images, load_digits().images)
        np.testing.assert_array_equal(labels, load_digits().target)
    finally:
        digits.digits_arrays.cache_clear()
