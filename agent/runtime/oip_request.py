"""What the Open Inference Protocol's requests may carry, checked once for HTTP and gRPC.

Both front ends (:mod:`agent.runtime.oip_codec` for HTTP/REST, :mod:`agent.runtime.oip_grpc`)
turn a request into the same typed parts (:class:`InputTensor` headers, validated strictly by
pydantic, unknown keys refused; :class:`RequestedOutput`), the same checks turn each tensor's
values into a numpy array (:mod:`agent.runtime.oip_tensors`), and the same binding checks them
against the model (:class:`ModelSignature`):

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
- the outputs are the model's, each of the datatype its metadata declares (a detector's
  INT32 ``num_detections`` and ``classes`` answered as JSON integers, or raw little-endian
  int32, beside its FP32 ``boxes`` and ``scores``);
- requested outputs name outputs the model has (an unknown one is refused, listing the known
  ones); only those are answered; with none requested, every output is;
- an answer carries finite numbers only: a model output holding NaN or Inf is an error (500,
  gRPC INTERNAL), never a ``NaN`` token in a JSON body.

Checks run on whole arrays in numpy, never value by value in Python. A refusal is a
:class:`~agent.runtime.oip_tensors.ProtocolError` naming the input and the fix (400, gRPC
INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent.runtime.engine_outputs import TensorSpec
from agent.runtime.engines import ServingEngine
from agent.runtime.oip_tensors import DATATYPES, UNSUPPORTED, ProtocolError, brief

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
    """Each value a string, a finite number or a boolean; a key of ``unsupported`` refused; a
    key of ``booleans`` true or false."""
    for key, value in (params or {}).items():
        if key in unsupported:
            raise ValueError(f"{key}: this server does not support the extension that uses "
                             "it (shared memory, classification): send and take the values "
                             "in the request and response")
        if type(value) not in (bool, int, float, str) or (
                type(value) is float and not math.isfinite(value)):
            raise ValueError(f"{key}: a string, a finite number or a boolean (got "
                             f"{brief(value)})")
        if key in booleans and type(value) is not bool:
            raise ValueError(f"{key} {brief(value)}: true or false")
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
            raise ValueError(f"binary_data_size {brief(size)}: a byte count (an integer >= 0)")
        return v

    @property
    def binary_data_size(self) -> int | None:
        size = (self.parameters or {}).get("binary_data_size")
        return size if isinstance(size, int) else None


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
                msg += f" (got {brief(err.get('input'))})"
            lines.append(f"{_loc(tuple(err['loc']), where)}: {msg}")
        more = f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else ""
        raise ProtocolError(400, "invalid inference request: " + "; ".join(lines) + more
                            ) from None


def where_of(index: int, t: InputTensor) -> str:
    """How an error names the input: position and name."""
    return f"inputs[{index}] ({t.name!r})"


# -- the model's side: what it takes and answers

@dataclass(frozen=True)
class ModelSignature:
    """The model's inputs and outputs: what requests are checked against."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, engine: ServingEngine) -> ModelSignature:
        # The input FP32: the ServingEngine contract (float32 NCHW in), which ActiveModel
        # enforces. The outputs as the engine declares them (a detector's INT32 counts and
        # classes beside its FP32 boxes and scores); the metadata endpoints list the same.
        return cls((TensorSpec(engine.input_name, "FP32", tuple(engine.input_shape)),),
                   tuple(engine.outputs))

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
    """Refuse a request with another number of inputs than the model has (told before each
    tensor is read: a request meant for another model is told so first)."""
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
        if w.name not in results:  # checked against the version that was serving a moment ago
            raise ProtocolError(503, f"output {w.name!r} is not among the outputs of the "
                                f"version that answered ({', '.join(results)}): a version "
                                "with other outputs was committed meanwhile; send it again")
        arr = np.asarray(results[w.name])
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ProtocolError(500, f"the model's output {w.name!r} holds NaN or Inf for this "
                                "input: not answered (the protocol carries finite numbers "
                                "only); check the input's scale, or the model")
        out.append((w, arr))
    return out
