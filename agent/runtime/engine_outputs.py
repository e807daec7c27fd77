"""What a serving engine gives back: each output's declared name, datatype and shape
(:class:`TensorSpec`, what the Open Inference Protocol's metadata lists), and one run's arrays
(:class:`EngineOutputs`, by name, in the model's order).

A classifier has one output (its float32 logits); an exported detector has four, shaped like
TensorRT's ``EfficientNMS_TRT`` plugin's: ``num_detections [N, 1]`` INT32, ``boxes [N, K, 4]``
FP32, ``scores [N, K]`` FP32, ``classes [N, K]`` INT32. Every output is batch-first, so a batch
run in slices is put back together output by output (:meth:`EngineOutputs.concat`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.runtime.oip_tensors import DATATYPES

ONNX_DATATYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64", "tensor(int8)": "INT8",
    "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64"}
"""ONNX Runtime's type names (``NodeArg.type``) as the protocol's datatypes."""


@dataclass(frozen=True)
class TensorSpec:
    """A model tensor as its metadata declares it."""

    name: str
    datatype: str
    """The protocol's datatype: FP32, INT32, INT64, ..."""
    shape: tuple[int, ...]
    """-1 where a dimension varies."""

    def fits(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(
            w in (-1, g) for w, g in zip(self.shape, shape, strict=True))

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def onnx_datatype(type_name: str, output: str) -> str:
    """The protocol's datatype of an ONNX Runtime tensor type (``tensor(int32)``: INT32); a
    ValueError naming ``output`` for a type the protocol cannot carry (strings, bfloat16)."""
    try:
        return ONNX_DATATYPES[type_name]
    except KeyError:
        raise ValueError(f"output {output!r} is a {type_name}: this server answers numeric "
                         f"tensors only ({', '.join(ONNX_DATATYPES)})") from None


def numpy_datatype(dtype: Any, output: str) -> str:
    """The protocol's datatype of a numpy dtype (TensorRT's ``trt.nptype`` gives one)."""
    little = np.dtype(dtype).newbyteorder("<")
    for d in DATATYPES.values():
        if d.dtype == little:
            return d.name
    raise ValueError(f"output {output!r} is {np.dtype(dtype)}: the protocol has no datatype "
                     "for it")


class EngineOutputs(dict[str, np.ndarray]):
    """One run's outputs, name -> array, in the model's order.

    A one-output model's also reads as that output's array wherever numpy takes an array
    (``np.asarray``, ``np.concatenate``): code written for runners that give one array
    (``exporters.runtime.predict`` and ``measure_latency``, through which the device's health
    check scores the runtime that serves a version) keeps working for a classifier. A model
    with several outputs has no one array: it is read by name."""

    def sole(self) -> np.ndarray:
        """The only output; a TypeError naming the outputs when there are several."""
        if len(self) != 1:
            raise TypeError(f"the model has {len(self)} outputs ({', '.join(self)}), not one "
                            "array: read each by name")
        return next(iter(self.values()))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.sole()
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        return arr.copy() if copy else arr

    @classmethod
    def concat(cls, parts: Sequence[EngineOutputs]) -> EngineOutputs:
        """The runs of a batch's slices, in order, as the run of the whole batch: each output
        concatenated along its first (batch) dimension."""
        if len(parts) == 1:
            return parts[0]
        return cls((name, np.concatenate([p[name] for p in parts])) for name in parts[0])
