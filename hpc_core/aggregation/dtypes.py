"""Raw tensor bytes in a registry blob <-> float32 numpy arrays, for the dtypes we combine.

Weights are combined in float32 (norms and distances summed in float64 block by block).
Floating dtypes are decoded and re-encoded; anything else (integer counters such as
BatchNorm's ``num_batches_tracked``, booleans, float8) is not averaged: the aggregate keeps
the base's bytes for it.
"""

from __future__ import annotations

import numpy as np

from registry.manifest import DTYPE_SIZES

_NUMPY = {"F16": np.float16, "F32": np.float32, "F64": np.float64}
COMBINED = frozenset({"F16", "BF16", "F32", "F64"})
"""safetensors dtypes that are combined; tensors of other dtypes keep the base's values."""


def item_size(dtype: str) -> int:
    return DTYPE_SIZES[dtype]


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Little-endian bytes (a uint8 array, whole elements) -> float32."""
    if dtype == "BF16":
        # bfloat16 is the high half of a float32: shift it back into place.
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.dtype(_NUMPY[dtype]).newbyteorder("<")).astype(np.float32, copy=False)


def encode(values: np.ndarray, dtype: str) -> bytes:
    """float32 (or float64) values -> little-endian bytes of ``dtype``."""
    if dtype == "BF16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        # Round to nearest, ties to even, as torch does; NaN stays NaN.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = np.where(np.isnan(values), 0x7FC0, rounded)
        return rounded.astype("<u2").tobytes()
    return np.asarray(values).astype(np.dtype(_NUMPY[dtype]).newbyteorder("<")).tobytes()
