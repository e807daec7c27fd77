"""The Open Inference Protocol's tensor checks at their edges, one datatype at a time: the
exact bounds of every integer type, floats that round to a finite value against those that
overflow, raw bytes of every datatype, nested JSON data. (Attacks through the servers are in
tests/security/test_inference_inputs.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.runtime.oip_tensors import (
    DATATYPES,
    ProtocolError,
    tensor_from_bytes,
    tensor_from_json,
    tensor_from_values,
)

INTS = [d for d in DATATYPES.values() if d.kind in ("int", "uint")]


@pytest.mark.parametrize("dt", INTS, ids=[d.name for d in INTS])
def test_integer_types_take_their_exact_range_in_json_and_grpc(dt: Any) -> None:
    info = np.iinfo(dt.dtype)
    edges = [int(info.min), int(info.max)]
    got = tensor_from_json(edges, dt.name, [2], "x")
    assert got.dtype == dt.dtype and got.tolist() == edges
    assert tensor_from_values(edges, dt.name, [2], "x", "f").tolist() == edges
    for bad in (int(info.min) - 1, int(info.max) + 1):
        with pytest.raises(ProtocolError, match=rf"value 1 is {bad}, out of {dt.name}'s range"):
            tensor_from_json([0, bad], dt.name, [2], "x")
    with pytest.raises(ProtocolError, match="not an integer"):
        tensor_from_json([0, 0.5], dt.name, [2], "x")
    assert tensor_from_json([3.0], dt.name, [1], "x").tolist() == [3]


@pytest.mark.parametrize(("datatype", "ok", "overflow"), [
    # numpy's printed FP32 max (3.4028235e38) is past the exact one but rounds to it.
    ("FP32", [3.4028234663852886e38, -3.4028235e38, 1e-45], 3.5e38),
    ("FP16", [65504.0, -65519.0], 65520.0),
    ("FP64", [1.7976931348623157e308], None),
])
def test_floats_that_round_to_a_finite_value_pass_and_overflow_does_not(
        datatype: str, ok: list[float], overflow: float | None) -> None:
    got = tensor_from_json(ok, datatype, [len(ok)], "x")
    assert np.isfinite(got).all() and got.dtype == DATATYPES[datatype].dtype
    if overflow is not None:
        with pytest.raises(ProtocolError, match=f"out of {datatype}'s range"):
            tensor_from_json([overflow], datatype, [1], "x")


@pytest.mark.parametrize("dt", list(DATATYPES.values()), ids=list(DATATYPES))
def test_raw_bytes_of_every_datatype(dt: Any) -> None:
    values = np.array([1, 0, 1, 1, 0, 1], dtype=dt.dtype)
    got = tensor_from_bytes(values.tobytes(), dt.name, [2, 3], "x", "raw")
    assert got.shape == (2, 3) and got.ravel().tolist() == values.tolist()
    with pytest.raises(ProtocolError, match=f"7 bytes, but shape .2, 3. of {dt.name} is "
                       f"{6 * dt.itemsize} bytes"):
        tensor_from_bytes(b"\0" * 7, dt.name, [2, 3], "x", "raw")


def test_raw_bool_bytes_are_0_or_1_and_raw_floats_finite() -> None:
    with pytest.raises(ProtocolError, match="value 2 is the byte 2"):
        tensor_from_bytes(b"\x01\x00\x02", "BOOL", [3], "x", "raw")
    for dt in ("FP16", "FP32", "FP64"):
        raw = np.array([0, np.nan], DATATYPES[dt].dtype).tobytes()
        with pytest.raises(ProtocolError, match="value 1 is nan"):
            tensor_from_bytes(raw, dt, [2], "x", "raw")


def test_json_data_flat_or_nested_as_the_shape() -> None:
    flat = list(range(6))
    nested = [[0, 1, 2], [3, 4, 5]]
    for data in (flat, nested):
        assert tensor_from_json(data, "FP32", [2, 3], "x").tolist() == nested
    for bad in ([[0, 1], [2, 3], [4, 5]], [[0, 1, 2], [3, 4]], [[0, 1, 2], 3, 4, 5],
                [[[0, 1, 2]], [[3, 4, 5]]]):
        with pytest.raises(ProtocolError, match="nested data does not follow shape"):
            tensor_from_json(bad, "FP32", [2, 3], "x")
    assert tensor_from_json([True, False], "BOOL", [2], "x").tolist() == [True, False]
    with pytest.raises(ProtocolError, match="value 0 is an integer"):
        tensor_from_json([1], "BOOL", [1], "x")
