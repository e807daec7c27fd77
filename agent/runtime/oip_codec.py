"""The Open Inference Protocol's inference request and response bodies (KServe v2 / Triton
HTTP/REST), JSON and the binary tensor data extension, for one FP32 input and one output.

JSON: ``{"inputs": [{"name", "shape", "datatype": "FP32", "data": [...]}]}`` in,
``{"model_name", "model_version", "outputs": [{"name", "shape", "datatype", "data"}]}`` out;
``data`` flat in row-major order (nested lists are accepted too).

Binary extension (what tritonclient sends by default): the request header
``Inference-Header-Content-Length: N`` says the first N bytes of the body are the JSON, the
rest raw little-endian tensors, one per input with ``parameters.binary_data_size``. An output
is returned raw when the request asks (``outputs[i].parameters.binary_data`` or
``parameters.binary_data_output``): the response then carries the same header, and the
output's ``parameters.binary_data_size`` instead of ``data``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from registry.errors import MalformedJsonError
from registry.jsonsafe import loads_strict

HEADER_LENGTH = "Inference-Header-Content-Length"


class ProtocolError(Exception):
    """A request the protocol refuses: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class InferRequest:
    x: np.ndarray
    id: str | None
    binary_output: bool
    parameters: dict[str, Any]


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(400, f"{what} must be a JSON object")
    return value


def _json(data: bytes) -> dict[str, Any]:
    # The project's strict parser: bounded nesting and number literals, no NaN, no
    # duplicate keys (registry.jsonsafe says why each matters for input from outside).
    try:
        return _object(loads_strict(data, "request"), "the request")
    except MalformedJsonError as e:
        raise ProtocolError(400, str(e)) from None


def parse_infer(body: bytes, header_length: str | None, *, input_name: str,
                input_shape: tuple[int, ...]) -> InferRequest:
    """The request's input as a float32 array of a shape the model takes."""
    raw = b""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise ProtocolError(400, f"{HEADER_LENGTH} is not a number") from None
        if not 0 < n <= len(body):
            raise ProtocolError(400, f"{HEADER_LENGTH}={n} does not fit a {len(body)}-byte body")
        body, raw = body[:n], body[n:]
    req = _json(body)
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1:
        raise ProtocolError(400, f"'inputs' must list exactly one tensor (the model's "
                            f"{input_name!r})")
    t = _object(inputs[0], "inputs[0]")
    if t.get("name") != input_name:
        raise ProtocolError(400, f"unknown input {t.get('name')!r}: the model's input is "
                            f"{input_name!r}")
    if t.get("datatype") != "FP32":
        raise ProtocolError(400, f"input datatype {t.get('datatype')!r}: the model takes FP32")
    shape = t.get("shape")
    if (not isinstance(shape, list) or len(shape) != len(input_shape)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                       for d in shape)
            or any(w not in (-1, g) for w, g in zip(input_shape, shape, strict=True))):
        want = list(input_shape)
        raise ProtocolError(400, f"input shape {shape!r} does not fit the model's {want} "
                            "(-1: any size)")
    count = int(np.prod(shape))
    params = _object(t.get("parameters") or {}, "inputs[0].parameters")
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if size != 4 * count or size != len(raw):
            raise ProtocolError(400, f"binary_data_size {size!r}: {shape} FP32 is {4 * count} "
                                f"bytes and the body holds {len(raw)} after the JSON")
        x = np.frombuffer(raw, dtype="<f4").reshape(shape)
    else:
        if raw:
            raise ProtocolError(400, "binary data after the JSON but no input declares "
                                "binary_data_size")
        try:
            x = np.asarray(t.get("data"), dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise ProtocolError(400, f"input data is not a list of numbers: {e}") from None
        if x.size != count:
            raise ProtocolError(400, f"input data holds {x.size} values; shape {shape} needs "
                                f"{count}")
        x = x.reshape(shape)
    top = _object(req.get("parameters") or {}, "parameters")
    binary = bool(top.get("binary_data_output", False))
    for o in req.get("outputs") or []:
        binary = bool(_object(_object(o, "outputs[i]").get("parameters") or {},
                              "outputs[i].parameters").get("binary_data", binary))
    rid = req.get("id")
    return InferRequest(np.ascontiguousarray(x, dtype=np.float32),
                        rid if isinstance(rid, str) else None, binary, top)


def encode_infer(logits: np.ndarray, *, model_name: str, model_version: str | None,
                 output_name: str, request_id: str | None, binary: bool
                 ) -> tuple[bytes, dict[str, str]]:
    """The response body and the headers it needs beyond Content-Length."""
    out: dict[str, Any] = {"name": output_name, "datatype": "FP32", "shape": list(logits.shape)}
    raw = b""
    if binary:
        raw = np.ascontiguousarray(logits, dtype="<f4").tobytes()
        out["parameters"] = {"binary_data_size": len(raw)}
    else:
        out["data"] = logits.astype(np.float32).ravel().tolist()
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version or "",
                           "outputs": [out]}
    if request_id is not None:
        doc["id"] = request_id
    head = json.dumps(doc).encode()
    if not binary:
        return head, {"Content-Type": "application/json"}
    return head + raw, {"Content-Type": "application/octet-stream",
                        HEADER_LENGTH: str(len(head))}
