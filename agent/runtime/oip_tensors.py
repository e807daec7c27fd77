"""A tensor's values, from each of the Open Inference Protocol's encodings (JSON ``data``, the
binary tensor data extension, gRPC ``raw_input_contents`` and typed ``contents``), as one
checked numpy array of its declared datatype and shape.

Finite numbers only (no NaN or Inf, also not as raw bytes), within the datatype's range (a
float that overflows FP32, ``1e39``, is refused, not rounded to Inf; an integer outside INT8's
-128..127 is refused, not wrapped); JSON booleans and strings are not numbers; integer
datatypes take integral numbers; BOOL takes booleans (raw bytes 0 or 1); exactly as many values
as the shape holds (raw: shape x datatype size bytes), nested JSON data level by level as the
shape. What a request is beyond its values (names, shapes against the model, outputs) is
:mod:`agent.runtime.oip_request`'s.

Checks run on whole arrays in numpy; Python touches each value only through C-level builtins
(``map(type, ...)``, ``itertools.chain``), never in a Python loop, except to name the first bad
value of a request that is refused anyway. A refusal is a :class:`ProtocolError` naming the
input and the fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np


class ProtocolError(Exception):
    """A request the protocol refuses: ``status`` is the HTTP status to answer with (the gRPC
    server maps it to a status code)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- datatypes

Kind = Literal["bool", "int", "uint", "float"]


@dataclass(frozen=True)
class Datatype:
    """One of the protocol's tensor datatypes, as numpy holds it."""

    name: str
    dtype: np.dtype[Any]
    """Little-endian, as the binary extension and raw gRPC contents carry it."""
    kind: Kind
    contents: str | None
    """The gRPC ``InferTensorContents`` field that carries it (None: raw contents only)."""

    @property
    def named(self) -> str:
        """The name with its article, as it is read aloud: an FP32, an INT8, a UINT8."""
        return f"{'an' if self.name.startswith(('FP', 'INT')) else 'a'} {self.name}"

    @property
    def native(self) -> np.dtype[Any]:
        """The same type in this host's byte order: numpy's canonical dtype object, which
        ``ActiveModel``'s fast path recognises by identity."""
        return np.dtype(self.dtype.type)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def range_text(self) -> str:
        if self.kind == "float":
            return f"magnitude at most {np.finfo(self.dtype).max:g}"
        info = np.iinfo(self.dtype)
        return f"{info.min}..{info.max}"


def _dt(name: str, code: str, kind: Kind, contents: str | None) -> Datatype:
    return Datatype(name, np.dtype(code), kind, contents)


DATATYPES: dict[str, Datatype] = {d.name: d for d in (
    _dt("BOOL", "?", "bool", "bool_contents"),
    _dt("UINT8", "u1", "uint", "uint_contents"),
    _dt("UINT16", "<u2", "uint", "uint_contents"),
    _dt("UINT32", "<u4", "uint", "uint_contents"),
    _dt("UINT64", "<u8", "uint", "uint64_contents"),
    _dt("INT8", "i1", "int", "int_contents"),
    _dt("INT16", "<i2", "int", "int_contents"),
    _dt("INT32", "<i4", "int", "int_contents"),
    _dt("INT64", "<i8", "int", "int64_contents"),
    _dt("FP16", "<f2", "float", None),
    _dt("FP32", "<f4", "float", "fp32_contents"),
    _dt("FP64", "<f8", "float", "fp64_contents"),
)}
UNSUPPORTED = ("BF16", "BYTES")
"""The protocol's other datatypes: no model this server runs takes them."""


def datatype_of(array: np.ndarray) -> str:
    """The protocol's name for a numpy array's dtype (a model output's)."""
    for d in DATATYPES.values():
        if d.dtype == array.dtype.newbyteorder("<"):
            return d.name
    raise ProtocolError(500, f"the model answered a {array.dtype} tensor, which the protocol "
                        "has no datatype for")


# -- a tensor's values, from each encoding, to one checked numpy array

_JSON_KIND = {bool: "a boolean", str: "a string", type(None): "null", dict: "an object",
              list: "a list", int: "an integer", float: "a number"}
Shape = Sequence[int]


def brief(value: Any) -> str:
    """``repr(value)``, cut to fit in an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def tensor_from_json(data: list[Any], datatype: str, shape: Shape, where: str) -> np.ndarray:
    """JSON ``data`` (flat, or nested as ``shape``) as a checked array; ``where`` names the
    input in an error."""
    dt, count = DATATYPES[datatype], math.prod(shape)
    flat = _flatten(data, list(shape), where)
    if len(flat) != count:
        raise ProtocolError(400, f"{where}: input data holds {len(flat)} values; shape "
                            f"{list(shape)} needs {count}")
    allowed = {bool} if dt.kind == "bool" else {int, float}
    kinds = set(map(type, flat))
    if not kinds <= allowed:
        i = next(i for i, v in enumerate(flat) if type(v) not in allowed)
        what = "booleans (true/false)" if dt.kind == "bool" else "numbers"
        raise ProtocolError(400, f"{where}: input data is not a list of {what}: value {i} "
                            f"is {_JSON_KIND.get(type(flat[i]), 'not a number')} "
                            f"({brief(flat[i])}); {dt.named} tensor takes JSON {what}")
    if dt.kind == "bool":
        return np.array(flat, dtype=dt.dtype).reshape(shape)
    if dt.kind == "float" or float in kinds:
        wide = np.array(flat, dtype=np.float64)  # a JSON int has at most 40 digits: it fits
    else:
        try:
            wide = np.array(flat, dtype=np.uint64 if dt.name == "UINT64" else np.int64)
        except OverflowError:  # a literal past 64 bits: name it, then refuse
            info = np.iinfo(dt.dtype)
            i = next(i for i, v in enumerate(flat) if not info.min <= v <= info.max)
            raise ProtocolError(400, _range_message(where, dt, i, flat[i])) from None
    return narrow(wide, dt, where).reshape(shape)


def _flatten(data: list[Any], shape: list[int], where: str) -> list[Any]:
    """Nested ``data`` flattened, each level checked against ``shape``; flat data as is."""
    flat, level = data, 0
    while flat and type(flat[0]) is list:
        follows = (level + 1 < len(shape) and set(map(type, flat)) == {list}
                   and set(map(len, flat)) == {shape[level + 1]}
                   and (level > 0 or len(flat) == shape[0]))
        if not follows:
            raise ProtocolError(400, f"{where}: nested data does not follow shape {shape}: give "
                                "the values flat in row-major order, or nested level by level "
                                "as the shape")
        flat = list(itertools.chain.from_iterable(flat))
        level += 1
    return flat


def tensor_from_bytes(raw: bytes, datatype: str, shape: Shape, where: str, what: str
                      ) -> np.ndarray:
    """Raw little-endian values (binary extension, gRPC raw contents) as a checked array;
    ``what`` names the bytes in an error (``binary_data_size 8``, ``raw_input_contents[0]``)."""
    dt, count = DATATYPES[datatype], math.prod(shape)
    need = count * dt.itemsize
    if len(raw) != need:
        raise ProtocolError(400, f"{where}: {what}: {len(raw)} bytes, but shape {list(shape)} "
                            f"of {dt.name} is {need} bytes ({count} x {dt.itemsize})")
    arr = np.frombuffer(raw, dtype=dt.dtype)
    if dt.kind == "float":
        _check_finite(arr, dt, where)
    elif dt.kind == "bool":
        as_bytes = arr.view(np.uint8)
        bad = as_bytes > 1
        if bad.any():
            i = int(np.argmax(bad))
            raise ProtocolError(400, f"{where}: value {i} is the byte {int(as_bytes[i])}: a BOOL "
                                "tensor's raw bytes are 0 or 1")
    return arr.astype(dt.native, copy=False).reshape(shape)


def tensor_from_values(values: Sequence[Any], datatype: str, shape: Shape, where: str,
                       field: str) -> np.ndarray:
    """A gRPC ``contents.<field>`` (already typed by protobuf) as a checked array."""
    dt, count = DATATYPES[datatype], math.prod(shape)
    if len(values) != count:
        raise ProtocolError(400, f"{where}: contents.{field} holds {len(values)} values; shape "
                            f"{list(shape)} needs {count}")
    wide_type = {"bool": np.bool_, "float": np.float64, "int": np.int64, "uint": np.uint64}
    wide = np.fromiter(values, dtype=wide_type[dt.kind], count=len(values))
    return (wide if dt.kind == "bool" else narrow(wide, dt, where)).reshape(shape)


def narrow(wide: np.ndarray, dt: Datatype, where: str) -> np.ndarray:
    """``wide`` (float64, int64 or uint64) as ``dt`` after refusing what does not fit it: a
    non-integral number for an integer type, a value past its range, NaN/Inf for any."""
    if wide.dtype.kind == "f":
        _check_finite(wide, dt, where)
        if dt.kind == "float":
            with np.errstate(over="ignore"):
                out = wide.astype(dt.native)
            bad = ~np.isfinite(out)  # past the type's largest finite value: rounded to Inf
            if bad.any():
                i = int(np.argmax(bad))
                raise ProtocolError(400, _range_message(where, dt, i, float(wide[i])))
            return out
        bad = wide != np.trunc(wide)
        if bad.any():
            i = int(np.argmax(bad))
            raise ProtocolError(400, f"{where}: value {i} is {float(wide[i])!r}, not an "
                                f"integer: {dt.named} tensor takes integers")
    info = np.iinfo(dt.dtype)
    if wide.dtype.kind == "f":  # the bounds as exact floats: 2**63 is, 2**63 - 1 is not
        bad = (wide < float(info.min)) | (wide >= float(info.max + 1))
    else:  # numpy compares with a Python int outside the array's type exactly
        bad = (wide < info.min) | (wide > info.max)
    if bad.any():
        i = int(np.argmax(bad))
        raise ProtocolError(400, _range_message(where, dt, i, wide[i].item()))
    return wide.astype(dt.native)


def _check_finite(arr: np.ndarray, dt: Datatype, where: str) -> None:
    finite = np.isfinite(arr)
    if not finite.all():
        i = int(np.argmin(finite))
        raise ProtocolError(400, f"{where}: value {i} is {float(arr[i])}: {dt.named} tensor "
                            "takes finite numbers only (no NaN or Inf)")


def _range_message(where: str, dt: Datatype, i: int, v: Any) -> str:
    return (f"{where}: value {i} is {v!r}, out of {dt.name}'s range ({dt.range_text()}): "
            f"send values {dt.named} holds")
