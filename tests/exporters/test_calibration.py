from __future__ import annotations

import numpy as np
import pytest
import torch
from onnxruntime.quantization import CalibrationMethod
from pydantic import ValidationError

from exporters.calibration import (
    BatchReader,
    ort_calibration_method,
    ort_calibration_options,
    representative_inputs,
)
from exporters.job import CalibrationConfig
from hpc_core.data import TensorImageDataset


def _dataset(n: int) -> TensorImageDataset:
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    return TensorImageDataset(x, torch.zeros(n, dtype=torch.long))


def test_default_is_512_samples_minmax() -> None:
    cfg = CalibrationConfig()
    assert cfg.samples == 512 and cfg.method == "minmax"


def test_draws_distinct_samples_reproducibly() -> None:
    ds = _dataset(2000)
    a = representative_inputs(ds, 512, seed=3)
    b = representative_inputs(ds, 512, seed=3)
    c = representative_inputs(ds, 512, seed=4)
    assert a.shape == (512, 1, 2, 2) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(np.unique(a[:, 0, 0, 0])) == 512  # without replacement
    assert a[:, 0, 0, 0].max() > 1000  # from across the data set, not its head


def test_small_data_set_is_used_whole() -> None:
    ds = _dataset(100)
    x = representative_inputs(ds, 512)
    assert sorted(x[:, 0, 0, 0].tolist()) == list(range(100))


def test_reader_batches_and_rewinds() -> None:
    x = np.zeros((130, 1, 2, 2), np.float32)
    reader = BatchReader(x, "input", 64)
    sizes = []
    while (batch := reader.get_next()) is not None:
        sizes.append(len(batch["input"]))
    assert sizes == [64, 64, 2]
    reader.rewind()
    assert reader.get_next()["input"].shape == (64, 1, 2, 2)


@pytest.mark.parametrize(
    ("method", "ort"),
    [("minmax", CalibrationMethod.MinMax), ("percentile", CalibrationMethod.Percentile),
     ("entropy", CalibrationMethod.Entropy)],
)
def test_methods_map_to_onnxruntime(method: str, ort: CalibrationMethod) -> None:
    assert ort_calibration_method(method) is ort  # type: ignore[arg-type]


def test_percentile_passes_its_value() -> None:
    cfg = CalibrationConfig(method="percentile", percentile=99.99)
    assert ort_calibration_options(cfg) == {"CalibPercentile": 99.99}
    with pytest.raises(ValidationError):
        CalibrationConfig(method="kl")  # type: ignore[arg-type]
