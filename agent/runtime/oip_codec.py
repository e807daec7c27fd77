"""The Open Inference Protocol's inference request and response bodies over HTTP/REST (KServe
v2 / Triton HTTP), JSON and the binary tensor data extension. What a request may carry is checked
in :mod:`agent.runtime.oip_request`, the same code the gRPC server runs.

JSON: ``{"inputs": [{"name", "shape", "datatype", "data": [...]}], "outputs": [{"name"}]}``
in, ``{"model_name", "model_version", "outputs": [{"name", "shape", "datatype", "data"}]}``
out; ``data`` flat in row-major order (or nested as the shape). ``outputs`` in the request is
optional: given, only those outputs are answered, in that order. Each output keeps the
datatype the model's metadata declares: a detector's INT32 ``num_detections`` and ``classes``
are JSON integers (raw: little-endian int32), its ``boxes`` and ``scores`` FP32.

Binary extension (what tritonclient sends by default): the request header
``Inference-Header-Content-Length: N`` says the first N bytes of the body are the JSON, the
rest raw little-endian tensors, one per input with ``parameters.binary_data_size``, in the
order of ``inputs``. An output is returned raw when the request asks
(``outputs[i].parameters.binary_data``, or ``parameters.binary_data_output`` for every output):
the response then carries the same header, and the output's ``parameters.binary_data_size``
instead of ``data``.

Responses are strict JSON (``allow_nan=False``): a non-finite model output is refused with a
500 before a body is built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from agent.runtime.oip_request import (
    InferBody,
    InferRequest,
    ModelSignature,
    answered,
    bind_inputs,
    check_input_count,
    outputs_wanted,
    validated,
    where_of,
)
from agent.runtime.oip_tensors import (
    ProtocolError,
    datatype_of,
    tensor_from_bytes,
    tensor_from_json,
)
from registry.errors import MalformedJsonError
from registry.jsonsafe import loads_strict

__all__ = ["HEADER_LENGTH", "ProtocolError", "encode_infer", "parse_infer"]

HEADER_LENGTH = "Inference-Header-Content-Length"


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


def parse_infer(body: bytes, header_length: str | None, signature: ModelSignature
                ) -> InferRequest:
    """A request body (and its ``Inference-Header-Content-Length``), checked against the
    protocol and ``signature``: the model's input, and what to answer."""
    raw = b""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise ProtocolError(400, f"{HEADER_LENGTH} is not a number") from None
        if not 0 < n <= len(body):
            raise ProtocolError(400, f"{HEADER_LENGTH}={n} does not fit a {len(body)}-byte body")
        body, raw = body[:n], body[n:]
    doc = _json(body)
    inputs = doc.get("inputs")
    check_input_count(len(inputs) if isinstance(inputs, list) else 0, signature)
    req: InferBody = validated(InferBody, doc)
    tensors, offset = [], 0
    for i, t in enumerate(req.inputs):
        where, size = where_of(i, t), t.binary_data_size
        if size is None:
            if t.data is None:
                raise ProtocolError(400, f"{where}: no values: give 'data', or the binary "
                                    "extension's parameters.binary_data_size")
            tensors.append((t, tensor_from_json(t.data, t.datatype, t.shape, where)))
            continue
        if t.data is not None:
            raise ProtocolError(400, f"{where}: both 'data' and binary_data_size: give one")
        chunk = raw[offset:offset + size]
        if len(chunk) != size:
            raise ProtocolError(400, f"{where}: binary_data_size {size}: the body holds "
                                f"{len(raw) - offset} bytes for it after the JSON")
        offset += size
        tensors.append((t, tensor_from_bytes(chunk, t.datatype, t.shape, where,
                                             f"binary_data_size {size}")))
    if offset != len(raw):
        raise ProtocolError(400, "binary data after the JSON but no input declares "
                            "binary_data_size" if offset == 0 else
                            f"{len(raw) - offset} bytes after the inputs' binary data")
    return InferRequest(bind_inputs(tensors, signature), req.id,
                        outputs_wanted(req.outputs, signature, req.binary_data_output),
                        dict(req.parameters or {}))


def encode_infer(results: Mapping[str, np.ndarray], request: InferRequest, *, model_name: str,
                 model_version: str | None) -> tuple[bytes, dict[str, str]]:
    """The response body for the outputs ``request`` wants, and the headers it needs beyond
    Content-Length; a non-finite output is a :class:`ProtocolError` (500)."""
    outs: list[dict[str, Any]] = []
    raw: list[bytes] = []
    for wanted, arr in answered(results, request.outputs):
        out: dict[str, Any] = {"name": wanted.name, "datatype": datatype_of(arr),
                               "shape": list(arr.shape)}
        if wanted.binary:
            raw.append(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
            out["parameters"] = {"binary_data_size": len(raw[-1])}
        else:
            out["data"] = arr.ravel().tolist()
        outs.append(out)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version or "",
                           "outputs": outs}
    if request.id is not None:
        doc["id"] = request.id
    head = json.dumps(doc, allow_nan=False).encode()
    if not raw:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(raw), {"Content-Type": "application/octet-stream",
                                  HEADER_LENGTH: str(len(head))}
