"""What the Open Inference Protocol's requests may carry, checked once for HTTP and gRPC.

Both front ends (:mod:`agent.runtime.oip_codec` for HTTP/REST, :mod:`agent.runtime.oip_grpc`)
turn a request into the same typed parts (:class:`InputTensor` headers, :class:`OutputWanted`)
and the same checks turn each tensor's values into a numpy array:

- a tensor's values are of its declared datatype, in every encoding (JSON ``data``, the
  binary tensor data extension, gRPC ``raw_input_contents`` and typed ``contents``): finite
  numbers only (no NaN or Inf, also not as raw bytes), within the datatype's range (a float
  that overflows FP32, ``1e39``, is refused, not rounded to Inf; an integer outside INT8's
  -128..127 is refused, not wrapped); JSON booleans and strings are not numbers; integer
  datatypes take integral numbers; BOOL takes booleans (raw bytes 0 or 1);
- a tensor has exactly as many values as its shape says (raw: shape x datatype size bytes);
  nested JSON ``data`` follows the shape level by level;
- then the tensor must fit the model: its name, the datatype the model's metadata declares
  (FP32 today: every serving engine takes float32, and nothing is converted) and the shape;
- requested outputs name outputs the model has (an unknown one is refused, listing the known
  ones); only those are answered; with none requested, every output is;
- an answer carries finite numbers only: a model output holding NaN or Inf is an error (500,
  gRPC INTERNAL), never a ``NaN`` token in a JSON body.

Checks run on whole arrays in numpy; Python touches each value only through C-level builtins
(``map(type, ...)``), never in a Python loop, except to name the first bad value of a request
that is refused anyway. A refusal is a :class:`ProtocolError` naming the input and the fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent.runtime.engines import ServingEngine


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


# -- what a request names: its input tensors' headers, the outputs it wants

Parameters = dict[Annotated[str, Field(max_length=256)], Any]
"""The protocol's extension point: names to a string, a number or a boolean each."""
MAX_RANK = 32
MAX_NAME = 256
SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


class _Strict(BaseModel):
    # strict: no coercion (a "5" is not 5, a true is not 1); unknown keys are refused: the
    # protocol's objects have fixed keys, and ``parameters`` is its extension point.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _check_parameters(params: Parameters | None, *, unsupported: Sequence[str] = (),
                      booleans: Sequence[str] = ()) -> Parameters | None:
    """Values of the protocol's kinds; ``unsupported`` extensions refused; ``booleans`` are."""
    for key, value in (params or {}).items():
        if key in unsupported:
            raise ValueError(f"{key}: this server does not support the extension that uses "
                             "it (shared memory, classification): send and take the values "
                             "in the request and response")
        if type(value) not in (bool, int, float, str) or (
                type(value) is float and not math.isfinite(value)):
            raise ValueError(f"{key}: a string, a finite number or a boolean (got "
                             f"{_short(value)})")
        if key in booleans and type(value) is not bool:
            raise ValueError(f"{key} {_short(value)}: true or false")
    return params


class InputTensor(_Strict):
    """One input tensor's header (and, over HTTP/JSON, its ``data``)."""

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
    datatype: str
    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_RANK)]
    parameters: Parameters | None = None
    data: list[Any] | None = None
    """JSON only: the values, flat in row-major order or nested as the shape."""

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, v: str) -> str:
        if v in UNSUPPORTED:
            raise ValueError(f"{v} tensors are not supported by this server")
        if v not in DATATYPES:
            raise ValueError(f"{v[:32]!r} is not a datatype of the protocol (one of "
                             f"{', '.join([*DATATYPES, *UNSUPPORTED])})")
        return v

    @field_validator("parameters")
    @classmethod
    def _known_parameters(cls, v: Parameters | None) -> Parameters | None:
        _check_parameters(v, unsupported=SHARED_MEMORY)
        size = (v or {}).get("binary_data_size")
        if size is not None and (type(size) is not int or size < 0):
            raise ValueError(f"binary_data_size {_short(size)}: a byte count (an integer >= 0)")
        return v

    @property
    def binary_data_size(self) -> int | None:
        size = (self.parameters or {}).get("binary_data_size")
        return size if isinstance(size, int) else None

    @property
    def count(self) -> int:
        """How many values the shape holds (exact: Python ints never overflow)."""
        return math.prod(self.shape)


class RequestedOutput(_Strict):
    """One entry of a request's ``outputs``."""

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
    parameters: Parameters | None = None

    @field_validator("parameters")
    @classmethod
    def _known_parameters(cls, v: Parameters | None) -> Parameters | None:
        return _check_parameters(v, unsupported=(*SHARED_MEMORY, "classification"),
                                 booleans=("binary_data",))


class InferBody(_Strict):
    """An inference request's JSON body (HTTP/REST), the binary extension's header part."""

    id: Annotated[str, Field(max_length=1024)] | None = None
    parameters: Parameters | None = None
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None = None

    @field_validator("parameters")
    @classmethod
    def _known_parameters(cls, v: Parameters | None) -> Parameters | None:
        return _check_parameters(v, booleans=("binary_data_output",))

    @property
    def binary_data_output(self) -> bool:
        return bool((self.parameters or {}).get("binary_data_output", False))


def _loc(loc: tuple[int | str, ...], where: str) -> str:
    out = where
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "the request"


def validated(model: type[_Strict], doc: Any, where: str = "") -> Any:
    """``model.model_validate(doc)``, its errors told as one 400 (the first three), each at
    its path under ``where`` (``inputs[0]``, or the request's top level)."""
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        lines = []
        for err in e.errors(include_url=False)[:3]:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key (the protocol has no such field; custom values go in " \
                      "'parameters')"
            elif err["type"] not in ("value_error", "missing"):
                msg += f" (got {_short(err.get('input'))})"
            lines.append(f"{_loc(tuple(err['loc']), where)}: {msg}")
        more = f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else ""
        raise ProtocolError(400, "invalid inference request: " + "; ".join(lines) + more
                            ) from None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# -- a tensor's values, from each encoding, to one checked numpy array

_JSON_KIND = {bool: "a boolean", str: "a string", type(None): "null", dict: "an object",
              list: "a list", int: "an integer", float: "a number"}


def where_of(index: int, t: InputTensor) -> str:
    """How an error names the input: position and name."""
    return f"inputs[{index}] ({t.name!r})"


def tensor_from_json(t: InputTensor, where: str) -> np.ndarray:
    """``t.data`` (JSON) as a checked array of ``t.datatype`` and ``t.shape``."""
    dt = DATATYPES[t.datatype]
    flat = _flatten(t.data or [], t.shape, where)
    if len(flat) != t.count:
        raise ProtocolError(400, f"{where}: input data holds {len(flat)} values; shape "
                            f"{t.shape} needs {t.count}")
    allowed = {bool} if dt.kind == "bool" else {int, float}
    kinds = set(map(type, flat))
    if not kinds <= allowed:
        i = next(i for i, v in enumerate(flat) if type(v) not in allowed)
        what = "booleans (true/false)" if dt.kind == "bool" else "numbers"
        raise ProtocolError(400, f"{where}: input data is not a list of {what}: value {i} "
                            f"is {_JSON_KIND.get(type(flat[i]), 'not a number')} "
                            f"({_short(flat[i])}); {dt.named} tensor takes JSON {what}")
    if dt.kind == "bool":
        return np.array(flat, dtype=dt.dtype).reshape(t.shape)
    if dt.kind == "float" or float in kinds:
        wide = np.array(flat, dtype=np.float64)  # a JSON int has at most 40 digits: it fits
    else:
        try:
            wide = np.array(flat, dtype=np.uint64 if dt.name == "UINT64" else np.int64)
        except OverflowError:  # a literal past 64 bits: name it, then refuse
            info = np.iinfo(dt.dtype)
            i = next(i for i, v in enumerate(flat) if not info.min <= v <= info.max)
            raise ProtocolError(400, _range_message(where, dt, i, flat[i])) from None
    return narrow(wide, dt, where).reshape(t.shape)


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


def tensor_from_bytes(t: InputTensor, raw: bytes, where: str, what: str) -> np.ndarray:
    """Raw little-endian values (binary extension, gRPC raw contents) as a checked array;
    ``what`` names the bytes in an error (``binary_data_size 8``, ``raw_input_contents[0]``)."""
    dt = DATATYPES[t.datatype]
    need = t.count * dt.itemsize
    if len(raw) != need:
        raise ProtocolError(400, f"{where}: {what}: {len(raw)} bytes, but shape {t.shape} of "
                            f"{dt.name} is {need} bytes ({t.count} x {dt.itemsize})")
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
    return arr.astype(dt.dtype.newbyteorder("="), copy=False).reshape(t.shape)


def tensor_from_values(t: InputTensor, values: Sequence[Any], where: str, field: str
                       ) -> np.ndarray:
    """A gRPC ``contents.<field>`` (already typed by protobuf) as a checked array."""
    dt = DATATYPES[t.datatype]
    if len(values) != t.count:
        raise ProtocolError(400, f"{where}: contents.{field} holds {len(values)} values; shape "
                            f"{t.shape} needs {t.count}")
    wide_type = {"bool": np.bool_, "float": np.float64, "int": np.int64, "uint": np.uint64}
    wide = np.fromiter(values, dtype=wide_type[dt.kind], count=len(values))
    return (wide if dt.kind == "bool" else narrow(wide, dt, where)).reshape(t.shape)


def narrow(wide: np.ndarray, dt: Datatype, where: str) -> np.ndarray:
    """``wide`` (float64, int64 or uint64) as ``dt`` after refusing what does not fit it: a
    non-integral number for an integer type, a value past its range, NaN/Inf for any."""
    if wide.dtype.kind == "f":
        _check_finite(wide, dt, where)
        if dt.kind == "float":
            with np.errstate(over="ignore"):
                out = wide.astype(dt.dtype.newbyteorder("="))
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
    return wide.astype(dt.dtype.newbyteorder("="))


def _check_finite(arr: np.ndarray, dt: Datatype, where: str) -> None:
    finite = np.isfinite(arr)
    if not finite.all():
        i = int(np.argmin(finite))
        raise ProtocolError(400, f"{where}: value {i} is {float(arr[i])}: {dt.named} tensor "
                            "takes finite numbers only (no NaN or Inf)")


def _range_message(where: str, dt: Datatype, i: int, v: Any) -> str:
    return (f"{where}: value {i} is {v!r}, out of {dt.name}'s range ({dt.range_text()}): "
            f"send values {dt.named} holds")



# -- the model's side: what it takes and answers

@dataclass(frozen=True)
class TensorSpec:
    """A model tensor as its metadata declares it."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    """-1 where a dimension varies."""

    def fits(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(
            w in (-1, g) for w, g in zip(self.shape, shape, strict=True))

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class ModelSignature:
    """The model's inputs and outputs: what requests are checked against."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, engine: ServingEngine) -> ModelSignature:
        # FP32 both ways: the ServingEngine contract (float32 NCHW in, float32 out), which
        # ActiveModel enforces; the metadata endpoints declare the same.
        return cls((TensorSpec(engine.input_name, "FP32", tuple(engine.input_shape)),),
                   (TensorSpec(engine.output_name, "FP32", tuple(engine.output_shape)),))

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]


@dataclass(frozen=True)
class OutputWanted:
    """An output to answer, and whether raw (HTTP binary extension; gRPC answers raw)."""

    name: str
    binary: bool


@dataclass(frozen=True)
class InferRequest:
    """A request every check has passed: the model's input, ready to run."""

    x: np.ndarray
    id: str | None
    outputs: tuple[OutputWanted, ...]
    parameters: dict[str, Any]


def check_input_count(n: int, sig: ModelSignature) -> None:
    if n != len(sig.inputs):
        names = ", ".join(repr(i.name) for i in sig.inputs)
        raise ProtocolError(400, f"'inputs' must list exactly {_count(len(sig.inputs))} (the "
                            f"model's {names}); got {n}")


def _count(n: int) -> str:
    return "one tensor" if n == 1 else f"{n} tensors"


def bind_inputs(tensors: Sequence[tuple[InputTensor, np.ndarray]], sig: ModelSignature
                ) -> np.ndarray:
    """The model's input from checked tensors, after checking they are the ones it takes."""
    check_input_count(len(tensors), sig)
    ((t, x),) = tensors  # one model input today (ServingEngine takes one tensor)
    (spec,) = sig.inputs
    if t.name != spec.name:
        raise ProtocolError(400, f"unknown input {t.name!r}: the model's input is "
                            f"{spec.name!r}")
    if t.datatype != spec.datatype:
        raise ProtocolError(400, f"input datatype {t.datatype!r}: the model takes "
                            f"{spec.datatype} (its metadata says so; send {spec.datatype} "
                            "values, nothing is converted)")
    if not spec.fits(t.shape):
        raise ProtocolError(400, f"input shape {t.shape!r} does not fit the model's "
                            f"{list(spec.shape)} (-1: any size)")
    return x


def outputs_wanted(requested: Sequence[RequestedOutput] | None, sig: ModelSignature,
                   default_binary: bool = False) -> tuple[OutputWanted, ...]:
    """What to answer: the requested outputs in their order, or every output."""
    if not requested:
        return tuple(OutputWanted(o.name, default_binary) for o in sig.outputs)
    known, seen, out = sig.output_names, set(), []
    for i, r in enumerate(requested):
        if r.name not in known:
            raise ProtocolError(400, f"outputs[{i}]: unknown output {r.name!r}: the model's "
                                f"outputs are {known}")
        if r.name in seen:
            raise ProtocolError(400, f"outputs[{i}]: output {r.name!r} is requested twice")
        seen.add(r.name)
        binary = (r.parameters or {}).get("binary_data", default_binary)
        out.append(OutputWanted(r.name, bool(binary)))
    return tuple(out)


def answered(results: Mapping[str, np.ndarray], wanted: Sequence[OutputWanted]
             ) -> list[tuple[OutputWanted, np.ndarray]]:
    """The wanted outputs of a model run, each refused unless every value is finite."""
    out = []
    for w in wanted:
        arr = np.asarray(results[w.name])
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ProtocolError(500, f"the model's output {w.name!r} holds NaN or Inf for this "
                                "input: not answered (the protocol carries finite numbers "
                                "only); check the input's scale, or the model")
        out.append((w, arr))
    return out
