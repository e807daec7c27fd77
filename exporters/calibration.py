"""Calibration data for INT8: representative batches from the job's own training split.

The activation ranges of a Q/DQ model are fixed here, once; data unlike what the device
will see (or too little of it) is how INT8 accuracy collapses after deployment. The default
of 512 samples follows common post-training-quantization practice (TensorRT and Model
Optimizer examples use 500-1000 images).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod

from exporters.job import CalibMethod, CalibrationConfig

if TYPE_CHECKING:
    from torch.utils.data import Dataset

_ORT_METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "percentile": CalibrationMethod.Percentile,
    "entropy": CalibrationMethod.Entropy,
}


def ort_calibration_method(method: CalibMethod) -> CalibrationMethod:
    return _ORT_METHODS[method]


def ort_calibration_options(cfg: CalibrationConfig) -> dict[str, object]:
    """Method-specific ``extra_options`` for ``quantize_static``."""
    if cfg.method == "percentile":
        return {"CalibPercentile": cfg.percentile}
    return {}


def representative_inputs(dataset: Dataset, samples: int, seed: int = 0) -> np.ndarray:
    """``samples`` inputs drawn at random from ``dataset``, as one float32 NCHW array.

    A data set smaller than ``samples`` is used whole. Images only, whatever the task (a
    detector's targets are not needed to calibrate; its gates read them from the held-out
    split). Drawn by the torch half of an export
    (``exporters.prepare``); the quantizing half reads them back and never imports torch.
    """
    import torch
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("the calibration data set is empty")
    take = min(samples, n)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:take]
    x = getattr(dataset, "x", None)
    if isinstance(x, torch.Tensor):
        # In-memory data sets: gather in one indexing op.
        return x[idx].numpy().astype(np.float32, copy=False)
    return torch.stack([dataset[int(i)][0] for i in idx]).numpy().astype(np.float32)


class BatchReader(CalibrationDataReader):
    """Feeds fixed batches to ONNX Runtime's calibrator; ``rewind`` allows another pass."""

    def __init__(self, inputs: np.ndarray, input_name: str, batch_size: int) -> None:
        self.batches = [
            inputs[i : i + batch_size] for i in range(0, len(inputs), batch_size)
        ]
        self.input_name = input_name
        self._it: Iterator[np.ndarray] = iter(self.batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._it, None)
        return None if batch is None else {self.input_name: batch}

    def rewind(self) -> None:
        self._it = iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
