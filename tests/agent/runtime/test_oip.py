"""The Open Inference Protocol server answered by real clients (http.client, urllib,
tritonclient) over loopback TCP and a Unix socket; bad requests get a 4xx naming the problem
and the server goes on serving; connections, bodies and slow clients are bounded."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.runtime.active_model import ActiveModel
from agent.runtime.oip import OipLimits, OipServer
from tests.agent.runtime.conftest import MODEL, Device, served_version
from tests.agent.runtime.test_active_model import ListSpool, wait_for


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = 10) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def infer_body(shape: list[int] | None = None, **over: Any) -> bytes:
    shape = shape or [2, 1, 8, 8]
    tensor = {"name": "input", "shape": shape, "datatype": "FP32",
              "data": [0.0] * int(np.prod(shape)), **over}
    return json.dumps({"inputs": [tensor]}).encode()


def call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn.request(method, path, body, headers or {})
    r = conn.getresponse()
    data = r.read()
    return r.status, json.loads(data) if data else None


@pytest.fixture
def serve(device: Device, tmp_path: Path) -> Iterator[Callable[..., tuple[OipServer, Any]]]:
    """serve(transport="tcp"|"unix", limits=..., spool=...) -> (server, connection factory)."""
    opened: list[Any] = []

    def start(transport: str = "tcp", limits: OipLimits | None = None,
              spool: Any = None, install: bool = True) -> tuple[OipServer, Any]:
        if install and device.slots.active() is None:
            device.install(1)
        model = ActiveModel(device.state, MODEL, poll_s=0.02, spool=spool)
        sock = tmp_path / f"oip-{len(opened)}.sock" if transport == "unix" else None
        server = OipServer(model, port=0, unix_socket=sock, limits=limits).start()
        opened.append((server, model))
        if sock is not None:
            return server, lambda: UnixHTTPConnection(sock)
        return server, lambda: http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)

    yield start
    for server, model in opened:
        server.close()
        model.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_every_endpoint_answers_as_the_protocol_says(
        serve: Callable[..., Any], device: Device, transport: str) -> None:
    server, connect = serve(transport)
    c = connect()
    assert call(c, "GET", "/v2/health/live") == (200, {"live": True})
    assert call(c, "GET", "/v2/health/ready") == (200, {"ready": True})
    assert call(c, "GET", "/v2/models/digits/ready") == (200, {"name": "digits", "ready": True})
    status, meta = call(c, "GET", "/v2/models/digits")
    assert status == 200 and meta == {
        "name": "digits", "versions": ["1"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]}
    status, out = call(c, "POST", "/v2/models/digits/infer", infer_body(),
                       {"Content-Type": "application/json"})
    assert status == 200 and out["model_name"] == "digits" and out["model_version"] == "1"
    (o,) = out["outputs"]
    assert (o["name"], o["datatype"], o["shape"]) == ("logits", "FP32", [2, 10])
    assert served_version(np.array(o["data"], np.float32).reshape(2, 10)) == 1
    assert call(c, "POST", "/v2/models/digits/versions/1/infer", infer_body())[0] == 200

    device.install(2)  # a commit is followed by the same server, the same connection
    wait_for(lambda: server.model.version == "2", what="v2")
    status, out = call(c, "POST", "/v2/models/digits/infer", infer_body())
    assert out["model_version"] == "2" and out["outputs"][0]["data"][0] == 2.0
    status, err = call(c, "POST", "/v2/models/digits/versions/1/infer", infer_body())
    assert status == 404 and "'1' of 'digits' is not served (serving '2')" in err["error"]
    status, err = call(c, "GET", "/v2/models/cats")
    assert status == 404 and "unknown model 'cats'" in err["error"]


def test_urllib_over_loopback(serve: Callable[..., Any]) -> None:
    server, _ = serve()
    url = f"http://127.0.0.1:{server.port}/v2/models/digits/infer"
    req = urllib.request.Request(url, data=infer_body([1, 1, 8, 8]),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and json.load(r)["outputs"][0]["shape"] == [1, 10]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=10)
    assert e.value.code == 404


def test_tritonclient_infers_with_binary_and_json_tensors(serve: Callable[..., Any]) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    server, _ = serve()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits")
    meta = client.get_model_metadata("digits")
    assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
    x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
    want = server.model.predict(x)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)  # binary tensor data extension (the client's default)
    res = client.infer("digits", [inp])
    np.testing.assert_array_equal(res.as_numpy("logits"), want)
    inp.set_data_from_numpy(x, binary_data=False)
    res = client.infer("digits", [inp], model_version="1", request_id="r7",
                       outputs=[httpclient.InferRequestedOutput("logits", binary_data=False)])
    np.testing.assert_allclose(res.as_numpy("logits"), want, rtol=1e-6)
    assert res.get_response()["id"] == "r7"
    client.close()


BAD = [
    ("malformed JSON", b'{"inputs": [', {}, 400, "not valid JSON"),
    ("wrong shape", infer_body([2, 3, 8, 8]), {}, 400, "does not fit the model's [-1, 1, 8, 8]"),
    ("wrong datatype", infer_body(datatype="INT64"), {}, 400, "the model takes FP32"),
    ("too few values", infer_body(data=[0.0] * 10), {}, 400, "holds 10 values"),
    ("not numbers", infer_body([1, 1, 8, 8], data=["x"] * 64), {}, 400, "not a list of numbers"),
    ("wrong input", infer_body(name="image"), {}, 400, "the model's input is 'input'"),
    ("two inputs", b'{"inputs": [{}, {}]}', {}, 400, "exactly one tensor"),
    ("NaN", infer_body([1, 1, 8, 8], data=[float("nan")] * 64), {}, 400, "NaN is not JSON"),
    ("binary header past the body", infer_body(), {"Inference-Header-Content-Length": "99999"},
     400, "does not fit"),
    ("binary size mismatch",
     json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                             "parameters": {"binary_data_size": 8}}]}).encode() + b"\0" * 8,
     "header", 400, "binary_data_size 8"),
    ("oversized", b"x" * 5000, {}, 413, "over the server's limit of 4096"),
    ("compressed", infer_body(), {"Content-Encoding": "gzip"}, 415, "compressed"),
]


@pytest.mark.parametrize(("what", "body", "headers", "status", "message"), BAD,
                         ids=[b[0] for b in BAD])
def test_bad_requests_get_a_4xx_and_serving_goes_on(
        serve: Callable[..., Any], what: str, body: bytes, headers: Any, status: int,
        message: str) -> None:
    _, connect = serve(limits=OipLimits(max_body_bytes=4096))
    if headers == "header":  # the JSON's own length, then the (wrong-sized) raw bytes
        headers = {"Inference-Header-Content-Length": str(len(body) - 8)}
    c = connect()
    got, err = call(c, "POST", "/v2/models/digits/infer", body, headers)
    assert got == status and message in err["error"], err
    ok, out = call(connect(), "POST", "/v2/models/digits/infer", infer_body())
    assert ok == 200 and out["outputs"][0]["data"][0] == 1.0


def test_methods_routes_and_missing_length(serve: Callable[..., Any]) -> None:
    server, connect = serve()
    c = connect()
    assert call(c, "GET", "/v2/models/digits/infer")[0] == 405
    assert call(c, "POST", "/v2/health/live", b"{}")[0] == 405
    assert call(c, "GET", "/v2/nowhere")[0] == 404
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n\r\n")
        head = b"".join(iter(lambda: s.recv(4096), b"")).decode()  # to the server's close
    assert head.startswith("HTTP/1.1 411") and "Content-Length is required" in head


def test_connections_are_bounded_and_a_silent_client_times_out(
        serve: Callable[..., Any]) -> None:
    server, connect = serve(limits=OipLimits(max_connections=2, request_timeout_s=0.5))
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    time.sleep(0.1)  # both accepted and holding a slot
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as third:
        assert third.recv(4096).startswith(b"HTTP/1.1 503")
    t0 = time.monotonic()
    for s in idle:  # silent: the server drops each after request_timeout_s
        s.settimeout(10)
        assert s.recv(4096) == b""
        s.close()
    assert time.monotonic() - t0 < 5

    # A slot is released just after its socket is closed: wait for both, without a probe
    # connection that would itself hold one.
    wait_for(lambda: server.open_connections == 0, what="the idle connections' slots")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
        # A body that never finishes: 408, then the connection is closed.
        slow.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100\r\n\r\n{\"inputs\"")
        assert slow.recv(4096).startswith(b"HTTP/1.1 408")
    assert call(connect(), "GET", "/v2/health/ready")[0] == 200


def test_not_ready_until_a_version_is_committed(serve: Callable[..., Any],
                                                device: Device) -> None:
    server, connect = serve(install=False)
    c = connect()
    assert call(c, "GET", "/v2/health/live")[0] == 200
    assert call(c, "GET", "/v2/health/ready") == (400, {"ready": False})
    assert call(c, "GET", "/v2/models/digits/ready")[0] == 400
    status, err = call(c, "POST", "/v2/models/digits/infer", infer_body())
    assert status == 503 and "no version of 'digits' serves yet" in err["error"]
    device.install(1)
    wait_for(lambda: server.model.version == "1", what="v1")
    assert call(c, "POST", "/v2/models/digits/infer", infer_body())[0] == 200


def test_record_needs_a_spool_and_hands_samples_to_it(serve: Callable[..., Any]) -> None:
    _, connect = serve()
    status, err = call(connect(), "POST", "/v2/models/digits/record", infer_body())
    assert status == 404 and "no spool configured" in err["error"]
    spool = ListSpool()
    _, connect = serve(spool=spool)
    body = json.loads(infer_body([1, 1, 8, 8]))
    body["parameters"] = {"label": 7}
    status, out = call(connect(), "POST", "/v2/models/digits/record", json.dumps(body).encode())
    assert status == 200 and out["stored"] == 1 and spool.items[0][1] == 7
    body["parameters"] = {"label": "seven"}
    status, err = call(connect(), "POST", "/v2/models/digits/record", json.dumps(body).encode())
    assert status == 400 and "not an integer" in err["error"]


def test_a_live_unix_socket_is_not_taken_over(serve: Callable[..., Any], tmp_path: Path) -> None:
    server, _ = serve("unix")
    with pytest.raises(OSError, match="another server listens"):
        OipServer(server.model, unix_socket=server.unix_socket)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a socket"):
        OipServer(server.model, unix_socket=tmp_path / "file")


def test_commits_under_load_over_http_fail_no_request(serve: Callable[..., Any],
                                                      device: Device) -> None:
    """Four kept-alive clients infer without pause while three versions are committed: every
    request is answered 200, each client sees versions only move forward, every one serves."""
    _, connect = serve()
    stop = threading.Event()
    seen: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        c = connect()
        try:
            while not stop.is_set():
                status, out = call(c, "POST", "/v2/models/digits/infer",
                                   infer_body([1 + i, 1, 8, 8]))
                assert status == 200, out
                data = np.array(out["outputs"][0]["data"], np.float32).reshape(1 + i, 10)
                seen[i].append(served_version(data))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for k in (2, 3, 4):
            device.install(k)
            wait_for(lambda k=k: any(k in s for s in seen) or bool(errors), what=f"v{k}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert set().union(*seen) == {1, 2, 3, 4}
    assert all(s == sorted(s) for s in seen)
