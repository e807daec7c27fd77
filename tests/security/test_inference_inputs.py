"""Hostile inference requests against ``agentctl serve``'s servers, over HTTP (raw bodies, as
an attacker writes them) and gRPC (tritonclient's own protobuf classes and stubs, so the wire
is checked against an independent implementation): values that are not finite numbers of the
declared datatype, in every encoding, wrong byte counts, integers out of range, outputs the
model does not have. Each is refused (400 / INVALID_ARGUMENT) with a message naming the input
and the fix; no answer ever carries a NaN token; good requests are answered exactly as the
model answers directly; the servers go on serving."""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from agent.runtime.active_model import ActiveModel
from agent.runtime.oip import OipServer
from agent.runtime.oip_grpc import OipGrpcServer
from registry.signing import SigningKey
from tests.agent.runtime.conftest import MODEL, Device, runtime_key  # noqa: F401 (fixture)

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")

SHAPE = [2, 1, 8, 8]
COUNT = 128


@dataclass
class Served:
    model: ActiveModel
    http: OipServer
    grpc: OipGrpcServer
    stub: Any

    def post(self, body: bytes, headers: dict[str, str] | None = None
             ) -> tuple[int, bytes, dict[str, str]]:
        c = http.client.HTTPConnection("127.0.0.1", self.http.port, timeout=10)
        try:
            c.request("POST", f"/v2/models/{MODEL}/infer", body, headers or {})
            r = c.getresponse()
            return r.status, r.read(), dict(r.getheaders())
        finally:
            c.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           runtime_key: tuple[SigningKey, Path]) -> Iterator[Served]:  # noqa: F811
    """One model, both servers, for the whole module: every attack hits the same servers,
    which must keep serving."""
    where = tmp_path_factory.mktemp("inference-inputs")
    device = Device(where / "state", where / "work", *runtime_key)
    device.state.mkdir()
    device.install(1)
    model = ActiveModel(device.state, MODEL, poll_s=0.05, threads=1)
    http_server = OipServer(model, port=0).start()
    grpc_server = OipGrpcServer(model, port=0).start()
    channel = grpc.insecure_channel(grpc_server.address)
    try:
        yield Served(model, http_server, grpc_server,
                     service_pb2_grpc.GRPCInferenceServiceStub(channel))
    finally:
        channel.close()
        grpc_server.close()
        http_server.close()
        model.close()


def strict_json(data: bytes) -> Any:
    """The body parsed as JSON proper: a NaN/Infinity token fails here."""
    def refuse(token: str) -> Any:
        raise AssertionError(f"{token} in a response body: not JSON")
    return json.loads(data, parse_constant=refuse)


def body(data: Any = None, *, datatype: str = "FP32", shape: list[int] | None = None,
         outputs: list[dict[str, Any]] | None = None, **tensor: Any) -> bytes:
    t = {"name": "input", "shape": shape or SHAPE, "datatype": datatype,
         "data": [0.0] * COUNT if data is None else data, **tensor}
    doc: dict[str, Any] = {"inputs": [t]}
    if outputs is not None:
        doc["outputs"] = outputs
    # allow_nan: an attacker's body, written as Python's json would write NaN
    return json.dumps(doc, allow_nan=True).encode()


def binary_body(raw: bytes, *, size: int | None = None, shape: list[int] | None = None,
                datatype: str = "FP32") -> tuple[bytes, dict[str, str]]:
    head = json.dumps({"inputs": [{"name": "input", "shape": shape or SHAPE,
                                   "datatype": datatype, "parameters": {
                                       "binary_data_size": len(raw) if size is None else size}}]}
                      ).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


def with_one(value: Any, at: int = 5, fill: Any = 0.5) -> list[Any]:
    data = [fill] * COUNT
    data[at] = value
    return data


def f32_bytes(value: float, at: int = 7) -> bytes:
    x = np.zeros(COUNT, np.float32)
    x[at] = value
    return x.tobytes()


HTTP_ATTACKS: list[tuple[str, Callable[[], tuple[bytes, dict[str, str]]], str]] = [
    ("strings", lambda: (body(["0.5"] * COUNT), {}),
     "inputs[0] ('input'): input data is not a list of numbers: value 0 is a string ('0.5')"),
    ("string NaN", lambda: (body(with_one("NaN")), {}), "value 5 is a string ('NaN')"),
    ("booleans", lambda: (body([True] * COUNT), {}), "value 0 is a boolean (True)"),
    ("one boolean among numbers", lambda: (body(with_one(False, at=100)), {}),
     "value 100 is a boolean"),
    ("null", lambda: (body(with_one(None)), {}), "value 5 is null"),
    ("1e39 overflows FP32", lambda: (body(with_one(1e39)), {}),
     "value 5 is 1e+39, out of FP32's range (magnitude at most 3.40282e+38)"),
    ("-1e39 overflows FP32", lambda: (body(with_one(-1e39, at=0)), {}),
     "value 0 is -1e+39, out of FP32's range"),
    ("NaN token", lambda: (body(with_one(float("nan"))), {}), "NaN is not JSON"),
    ("Infinity token", lambda: (body(with_one(float("inf"))), {}), "Infinity is not JSON"),
    ("1e400 literal", lambda: (body(with_one(1)).replace(b" 1,", b" 1e400,", 1), {}),
     "overflows"),
    ("binary NaN", lambda: binary_body(f32_bytes(float("nan"))),
     "value 7 is nan: an FP32 tensor takes finite numbers only (no NaN or Inf)"),
    ("binary Inf", lambda: binary_body(f32_bytes(float("-inf"))), "value 7 is -inf"),
    ("binary too short", lambda: binary_body(b"\0" * (4 * COUNT - 1)),
     f"binary_data_size {4 * COUNT - 1}: {4 * COUNT - 1} bytes, but shape {SHAPE} of FP32 is "
     f"{4 * COUNT} bytes"),
    ("binary size past the body", lambda: binary_body(b"\0" * 8, size=4 * COUNT),
     f"binary_data_size {4 * COUNT}: the body holds 8 bytes for it"),
    ("INT8 out of range", lambda: (body(with_one(300, fill=1), datatype="INT8"), {}),
     "value 5 is 300, out of INT8's range (-128..127)"),
    ("UINT8 negative", lambda: (body(with_one(-1, fill=1), datatype="UINT8"), {}),
     "value 5 is -1, out of UINT8's range (0..255)"),
    ("INT32 past 2**31", lambda: (body(with_one(2**31, fill=1), datatype="INT32"), {}),
     "value 5 is 2147483648, out of INT32's range"),
    ("INT64 past 64 bits", lambda: (body(with_one(2**64, fill=1), datatype="INT64"), {}),
     "value 5 is 18446744073709551616, out of INT64's range"),
    ("integer type, fraction", lambda: (body(with_one(1.5, fill=1), datatype="INT16"), {}),
     "value 5 is 1.5, not an integer"),
    ("INT8 binary is fine but not FP32", lambda: binary_body(b"\1" * COUNT, datatype="INT8"),
     "input datatype 'INT8': the model takes FP32"),
    ("BYTES", lambda: (body(["a"] * COUNT, datatype="BYTES"), {}),
     "BYTES tensors are not supported"),
    ("unknown datatype", lambda: (body(datatype="FP8"), {}), "'FP8' is not a datatype"),
    ("unknown requested output", lambda: (body(outputs=[{"name": "probs"}]), {}),
     "outputs[0]: unknown output 'probs': the model's outputs are ['logits']"),
    ("output requested twice", lambda: (body(outputs=[{"name": "logits"}] * 2), {}),
     "outputs[1]: output 'logits' is requested twice"),
    ("binary_data not a boolean",
     lambda: (body(outputs=[{"name": "logits", "parameters": {"binary_data": "yes"}}]), {}),
     "binary_data 'yes': true or false"),
    ("classification", lambda: (body(outputs=[{"name": "logits",
                                               "parameters": {"classification": 3}}]), {}),
     "does not support the extension"),
    ("unknown key", lambda: (body(dtype="FP32"), {}), "inputs[0].dtype: unknown key"),
    ("negative dimension", lambda: (body(shape=[2, 1, 8, -8]), {}),
     "inputs[0].shape[3]: Input should be greater than or equal to 0"),
    ("boolean dimension", lambda: (body(shape=[2, True, 8, 8]), {}),
     "inputs[0].shape[1]: Input should be a valid integer"),
    ("nested data off the shape", lambda: (body([[0.0] * 64, [0.0] * 63, [0.0]]), {}),
     "nested data does not follow shape"),
    ("shape and data disagree", lambda: (body([0.0] * 64), {}),
     "input data holds 64 values; shape [2, 1, 8, 8] needs 128"),
    ("parameters of a nested object", lambda: (body(parameters={"x": {"y": 1}}), {}),
     "x: a string, a finite number or a boolean"),
    ("id not a string", lambda: (json.dumps({"id": 7, "inputs": [json.loads(body())["inputs"][0]]}
                                            ).encode(), {}),
     "id: Input should be a valid string"),
]


@pytest.mark.parametrize(("what", "make", "message"), HTTP_ATTACKS,
                         ids=[a[0] for a in HTTP_ATTACKS])
def test_http_refuses_with_a_400_naming_the_input(
        served: Served, what: str, make: Callable[[], tuple[bytes, dict[str, str]]],
        message: str) -> None:
    data, headers = make()
    status, answer, _ = served.post(data, headers)
    assert status == 400, (status, answer)
    err = strict_json(answer)["error"]
    assert message in err, err
    status, answer, _ = served.post(body())  # the server goes on serving
    assert status == 200 and len(strict_json(answer)["outputs"][0]["data"]) == 20


def infer_request(datatype: str = "FP32", shape: list[int] | None = None,
                  raw: bytes | None = None, outputs: list[str] | None = None,
                  model: str = MODEL, **contents: Any) -> Any:
    """A ModelInferRequest built with tritonclient's classes (Triton's proto file)."""
    req = service_pb2.ModelInferRequest(model_name=model)
    t = req.inputs.add(name="input", datatype=datatype, shape=shape or SHAPE)
    if raw is not None:
        req.raw_input_contents.append(raw)
    for field, values in contents.items():
        getattr(t.contents, field).extend(values)
    for name in outputs or []:
        req.outputs.add(name=name)
    return req


def fp32(value: float, at: int = 9) -> list[float]:
    values = [0.25] * COUNT
    values[at] = value
    return values


GRPC_ATTACKS: list[tuple[str, Callable[[], Any], grpc.StatusCode, str]] = [
    ("typed NaN", lambda: infer_request(fp32_contents=fp32(math.nan)),
     grpc.StatusCode.INVALID_ARGUMENT,
     "inputs[0] ('input'): value 9 is nan: an FP32 tensor takes finite numbers only"),
    ("typed Inf", lambda: infer_request(fp32_contents=fp32(math.inf)),
     grpc.StatusCode.INVALID_ARGUMENT, "value 9 is inf"),
    # A float field cannot hold 1e39: the client's protobuf stores Inf, refused as such.
    ("typed 1e39", lambda: infer_request(fp32_contents=fp32(1e39)),
     grpc.StatusCode.INVALID_ARGUMENT, "value 9 is inf"),
    ("raw NaN", lambda: infer_request(raw=f32_bytes(math.nan)),
     grpc.StatusCode.INVALID_ARGUMENT, "value 7 is nan"),
    ("raw Inf", lambda: infer_request(raw=f32_bytes(math.inf)),
     grpc.StatusCode.INVALID_ARGUMENT, "value 7 is inf"),
    ("raw too long", lambda: infer_request(raw=b"\0" * (4 * COUNT + 4)),
     grpc.StatusCode.INVALID_ARGUMENT,
     f"raw_input_contents[0]: {4 * COUNT + 4} bytes, but shape {SHAPE} of FP32 is "
     f"{4 * COUNT} bytes"),
    ("booleans for FP32", lambda: infer_request(bool_contents=[True] * COUNT),
     grpc.StatusCode.INVALID_ARGUMENT,
     "contents.bool_contents for an FP32 tensor (booleans are not numbers): its values go in "
     "contents.fp32_contents"),
    ("strings for FP32", lambda: infer_request(bytes_contents=[b"0.5"] * COUNT),
     grpc.StatusCode.INVALID_ARGUMENT, "(strings are not numbers)"),
    ("FP64 1e39 is FP64, not FP32", lambda: infer_request("FP64", fp64_contents=fp32(1e39)),
     grpc.StatusCode.INVALID_ARGUMENT, "input datatype 'FP64': the model takes FP32"),
    ("INT8 out of range", lambda: infer_request("INT8", int_contents=[300] * COUNT),
     grpc.StatusCode.INVALID_ARGUMENT, "value 0 is 300, out of INT8's range (-128..127)"),
    ("UINT16 out of range", lambda: infer_request("UINT16", uint_contents=[70000] * COUNT),
     grpc.StatusCode.INVALID_ARGUMENT, "value 0 is 70000, out of UINT16's range (0..65535)"),
    ("raw and typed both", lambda: infer_request(raw=f32_bytes(0.0), fp32_contents=fp32(0.0)),
     grpc.StatusCode.INVALID_ARGUMENT, "both raw_input_contents and contents"),
    ("too few values", lambda: infer_request(fp32_contents=[0.0] * 5),
     grpc.StatusCode.INVALID_ARGUMENT, "contents.fp32_contents holds 5 values; shape"),
    ("unknown requested output", lambda: infer_request(raw=f32_bytes(0.0), outputs=["probs"]),
     grpc.StatusCode.INVALID_ARGUMENT,
     "outputs[0]: unknown output 'probs': the model's outputs are ['logits']"),
    ("wrong shape", lambda: infer_request(shape=[2, 3, 8, 8], raw=b"\0" * 4 * 384),
     grpc.StatusCode.INVALID_ARGUMENT, "does not fit the model's [-1, 1, 8, 8]"),
    ("another model", lambda: infer_request(model="cats", raw=f32_bytes(0.0)),
     grpc.StatusCode.NOT_FOUND, "unknown model 'cats'"),
]


@pytest.mark.parametrize(("what", "make", "code", "message"), GRPC_ATTACKS,
                         ids=[a[0] for a in GRPC_ATTACKS])
def test_grpc_refuses_with_invalid_argument_naming_the_input(
        served: Served, what: str, make: Callable[[], Any], code: grpc.StatusCode,
        message: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        served.stub.ModelInfer(make(), timeout=10)
    assert e.value.code() == code and message in e.value.details(), e.value.details()
    ok = served.stub.ModelInfer(infer_request(raw=f32_bytes(0.0)), timeout=10)
    assert ok.outputs[0].name == "logits" and len(ok.raw_output_contents[0]) == 2 * 10 * 4


def test_a_non_finite_output_is_an_error_never_a_nan_token(served: Served) -> None:
    # In FP32's range, so a valid input; the model's sums overflow on it.
    x = np.full(SHAPE, 3e38, np.float32)
    assert not np.isfinite(served.model.predict(x)).all()  # what the attack relies on
    for params in ({}, {"binary_data_output": True}):
        doc = json.loads(body(x.ravel().tolist()))
        doc["parameters"] = params
        status, answer, _ = served.post(json.dumps(doc).encode())
        assert status == 500  # and the body is JSON proper: strict_json refuses a NaN token
        assert "the model's output 'logits' holds NaN or Inf" in strict_json(answer)["error"]
    with pytest.raises(grpc.RpcError) as e:
        served.stub.ModelInfer(infer_request(raw=x.tobytes()), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "NaN or Inf" in e.value.details()


def test_good_requests_are_answered_as_the_model_answers(served: Served) -> None:
    x = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    want = served.model.predict(x)
    assert np.isfinite(want).all()

    status, answer, _ = served.post(body(x.ravel().tolist()))  # JSON, flat
    got = np.array(strict_json(answer)["outputs"][0]["data"], np.float32).reshape(2, 10)
    assert status == 200 and np.array_equal(got, want)
    status, answer, _ = served.post(body(x.tolist()))  # JSON, nested as the shape
    assert status == 200 and strict_json(answer)["outputs"][0]["data"] == want.ravel().tolist()
    ints = np.arange(COUNT, dtype=np.float32).reshape(SHAPE)  # JSON integers for FP32
    status, answer, _ = served.post(body(np.arange(COUNT).tolist()))
    assert status == 200 and strict_json(answer)["outputs"][0]["data"] == \
        served.model.predict(ints).ravel().tolist()

    data, headers = binary_body(x.tobytes())  # binary in, binary out as asked
    doc_len = int(headers["Inference-Header-Content-Length"])
    doc = json.loads(data[:doc_len])
    doc["outputs"] = [{"name": "logits", "parameters": {"binary_data": True}}]
    head = json.dumps(doc).encode()
    status, answer, resp_headers = served.post(
        head + data[doc_len:], {"Inference-Header-Content-Length": str(len(head))})
    n = int(resp_headers["Inference-Header-Content-Length"])
    meta = strict_json(answer[:n])
    assert status == 200 and meta["outputs"] == [
        {"name": "logits", "datatype": "FP32", "shape": [2, 10],
         "parameters": {"binary_data_size": 80}}]
    assert np.array_equal(np.frombuffer(answer[n:], "<f4").reshape(2, 10), want)

    raw = served.stub.ModelInfer(infer_request(raw=x.tobytes(), outputs=["logits"]), timeout=10)
    typed = served.stub.ModelInfer(infer_request(fp32_contents=x.ravel().tolist()), timeout=10)
    for r in (raw, typed):
        (out,) = r.outputs
        assert (out.name, out.datatype, list(out.shape)) == ("logits", "FP32", [2, 10])
        assert np.array_equal(np.frombuffer(r.raw_output_contents[0], "<f4").reshape(2, 10),
                              want)
        assert r.model_version == "1"
