"""``agentctl serve --grpc-port``: the Open Inference Protocol's gRPC service, answered to
``tritonclient.grpc`` by a real ``agentctl serve`` process on a real (small) model, as an
application talks to Triton: the same answers as HTTP, a hot swap under gRPC load losing no
request, RPCs past the bound refused RESOURCE_EXHAUSTED. The proto's descriptor is current and
matches Triton's wire names and numbers."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.runtime import oip_proto
from tests.agent.runtime.conftest import INPUT_SHAPE, Device, served_version
from tests.agent.runtime.test_oip import UnixHTTPConnection, call, infer_body

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Serve:
    proc: subprocess.Popen[str]
    sock: Path
    grpc_address: str
    events: list[dict[str, Any]]

    def http(self) -> UnixHTTPConnection:
        return UnixHTTPConnection(self.sock)

    def client(self) -> Any:
        return grpcclient.InferenceServerClient(self.grpc_address)


@contextmanager
def agentctl_serve(device: Device, tmp_path: Path, env: dict[str, str], *flags: str
                   ) -> Iterator[Serve]:
    """``agentctl serve`` on a Unix socket and a free gRPC port, JSON logs read as they come;
    stopped with SIGTERM at the end, which must exit 0."""
    sock = tmp_path / "oip.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "serve", "--state-dir", str(device.state),
         "--model", "digits", "--unix-socket", str(sock), "--grpc-port", "0", "--threads", "1",
         "--log-format", "json", *flags], env=env, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr or ()],
                              daemon=True)
    reader.start()
    events: list[dict[str, Any]] = []
    try:
        end = time.monotonic() + 30
        while not any(e.get("event") == "serving" for e in events):
            assert proc.poll() is None and time.monotonic() < end, "serve did not start"
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line.startswith("{"):
                events.append(json.loads(line))
        serving = next(e for e in events if e.get("event") == "serving")
        yield Serve(proc, sock, serving["grpc_address"], events)
        proc.send_signal(signal.SIGTERM)
        # Suite runs twice saw no exit within 20 and 60 s: the SIGTERM had landed on another
        # thread while the main one waited untimed (registry.lifetime.wait_for_stop). Should
        # it ever hang again, the log's last lines say where it stood.
        try:
            code: int | None = proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, (code, [lines.get_nowait() for _ in range(lines.qsize())][-20:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_tritonclient_grpc_gets_what_http_answers_and_a_hot_swap_under_load_loses_nothing(
        device: Device, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    device.install(1)
    with agentctl_serve(device, tmp_path, subprocess_env) as serve:
        host = serve.grpc_address.rsplit(":", 1)[0]
        assert host == "127.0.0.1"  # loopback, as HTTP, unless --host says otherwise
        c, http = serve.client(), serve.http()
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("digits")
        assert c.is_model_ready("digits", "1")
        assert c.get_server_metadata(as_json=True)["name"] == "edgetrain"
        status, meta = call(http, "GET", "/v2/models/digits")
        gmeta = c.get_model_metadata("digits", as_json=True)
        assert status == 200 and gmeta["versions"] == meta["versions"] == ["1"]
        assert gmeta["platform"] == meta["platform"]
        for key in ("inputs", "outputs"):
            assert [{**t, "shape": [int(d) for d in t["shape"]]} for t in gmeta[key]] == meta[key]

        x = np.random.default_rng(1).standard_normal((3, *INPUT_SHAPE)).astype(np.float32)
        body = json.loads(infer_body([3, *INPUT_SHAPE]))
        body["inputs"][0]["data"] = x.ravel().tolist()
        status, out = call(http, "POST", "/v2/models/digits/infer", json.dumps(body).encode())
        from_http = np.array(out["outputs"][0]["data"], np.float32).reshape(3, 10)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = c.infer("digits", [inp], model_version="1", request_id="r1",
                      outputs=[grpcclient.InferRequestedOutput("logits")])
        assert status == 200 and np.array_equal(res.as_numpy("logits"), from_http)
        assert res.get_response().id == "r1" and res.get_response().model_version == "1"
        with pytest.raises(InferenceServerException) as e:
            c.infer("digits", [inp], outputs=[grpcclient.InferRequestedOutput("probs")])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "unknown output 'probs': the model's outputs are ['logits']" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            c.infer("cats", [inp])
        assert e.value.status() == "StatusCode.NOT_FOUND"

        # Hot swap under load: three clients infer a zero batch back to back while two new
        # versions are committed; every request is answered, by one version, never an older
        # one than the client saw before.
        stop, failures = threading.Event(), []
        seen: list[list[int]] = [[] for _ in range(3)]

        def load(i: int) -> None:
            client = serve.client()
            zero = grpcclient.InferInput("input", [4, *INPUT_SHAPE], "FP32")
            zero.set_data_from_numpy(np.zeros((4, *INPUT_SHAPE), np.float32))
            while not stop.is_set():
                try:
                    r = client.infer("digits", [zero])
                    version = served_version(r.as_numpy("logits"))
                    assert r.get_response().model_version == str(version)
                    seen[i].append(version)
                except Exception as e:  # collected: an assert in a thread would be lost
                    failures.append(e)
            client.close()

        threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for version in (2, 3):
            time.sleep(0.3)
            device.install(version)
        end = time.monotonic() + 20
        while not all(s and s[-1] == 3 for s in seen):
            assert time.monotonic() < end and not failures, failures
            time.sleep(0.05)
        time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(10)
        assert failures == []
        for s in seen:
            assert s == sorted(s) and s[0] == 1 and s[-1] == 3, s
        assert sum(map(len, seen)) > 30
        c.close()


def slow_onnx(path: Path, width: int = 256, depth: int = 8) -> Path:
    """A model that takes a while per batch (``depth`` width x width MatMuls): RPCs stay in
    flight long enough to pile up on the concurrency bound."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(
        (rng.standard_normal((64, width)) / 8).astype(np.float32), "w_in")]
    nodes = [helper.make_node("Flatten", ["input"], ["h0"], axis=1),
             helper.make_node("MatMul", ["h0", "w_in"], ["h1"])]
    for k in range(depth):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        nodes.append(helper.make_node("MatMul", [f"h{k + 1}", f"w{k}"], [f"h{k + 2}"]))
    inits.append(numpy_helper.from_array(np.zeros((width, 10), np.float32), "w_out"))
    nodes.append(helper.make_node("MatMul", [f"h{depth + 1}", "w_out"], ["logits"]))
    graph = helper.make_graph(
        nodes, "slow", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                      ["batch", *INPUT_SHAPE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_rpcs_past_the_bound_are_refused_not_queued(
        device: Device, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    device.install(1, onnx_from=slow_onnx(tmp_path / "slow.onnx"))
    with agentctl_serve(device, tmp_path, subprocess_env, "--grpc-max-rpcs", "2",
                        "--grpc-workers", "2") as serve:
        x = np.ones((512, *INPUT_SHAPE), np.float32)
        n, start = 8, threading.Barrier(8)
        codes: list[str] = []

        def one() -> None:
            client = serve.client()
            inp = grpcclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            start.wait()
            try:
                client.infer("digits", [inp], client_timeout=60)
                codes.append("OK")
            except InferenceServerException as e:
                codes.append(f"{e.status()}: {e.message()}")
            client.close()

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        refused = [c for c in codes if c.startswith("StatusCode.RESOURCE_EXHAUSTED")]
        assert len(codes) == n and codes.count("OK") + len(refused) == n, codes
        assert refused and codes.count("OK") >= 2, codes
        assert "Concurrent RPC limit exceeded" in refused[0]
        client = serve.client()  # the bound frees as calls end: served again
        inp = grpcclient.InferInput("input", [1, *INPUT_SHAPE], "FP32")
        inp.set_data_from_numpy(np.zeros((1, *INPUT_SHAPE), np.float32))
        assert client.infer("digits", [inp]).as_numpy("logits").shape == (1, 10)
        client.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tgkill(2) is Linux's")
def test_a_sigterm_landing_on_any_thread_stops_serve(
        device: Device, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """The kernel may hand a process's SIGTERM to any of its threads (gRPC's, ONNX Runtime's,
    the HTTP server's); ``agentctl serve`` must stop all the same, as systemd expects. Sent here
    to another thread on purpose: left to the kernel, ~1 stop in 185 used to be missed."""
    device.install(1)
    libc = ctypes.CDLL(None, use_errno=True)
    with agentctl_serve(device, tmp_path, subprocess_env) as serve:
        pid = serve.proc.pid
        threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert threads, "serve runs its servers on threads of their own"
        assert libc.tgkill(pid, threads[-1], signal.SIGTERM) == 0, ctypes.get_errno()
        try:
            code = serve.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, "a SIGTERM on a thread other than the main one did not stop serve"


def test_the_descriptor_is_generated_from_the_proto_file() -> None:
    pytest.importorskip("grpc_tools")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_oip_proto.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_wire_is_tritons() -> None:
    """Every message and method of the proto file has Triton's names, numbers and types
    (tritonclient's generated classes are an independent copy of the protocol)."""
    ours = oip_proto.ServerLiveRequest.DESCRIPTOR.file
    theirs = service_pb2.DESCRIPTOR
    assert ours.package == theirs.package == "inference"

    def fields(d: Any) -> dict[str, Any]:
        return {f.name: (f.number, f.type, f.is_repeated,
                         f.message_type.full_name if f.message_type else None)
                for f in d.fields}

    def walk(d: Any) -> Iterator[Any]:
        yield d
        for n in d.nested_types:
            yield from walk(n)

    for top in ours.message_types_by_name.values():
        for d in walk(top):
            assert fields(d) == fields(theirs.pool.FindMessageTypeByName(d.full_name)), \
                d.full_name
    service = ours.services_by_name["GRPCInferenceService"]
    triton = theirs.services_by_name["GRPCInferenceService"]
    assert set(oip_proto.METHODS) == {m.name for m in service.methods}
    for m in service.methods:
        t = triton.methods_by_name[m.name]
        assert (m.input_type.full_name, m.output_type.full_name) == (
            t.input_type.full_name, t.output_type.full_name)


def test_grpc_on_a_non_loopback_host_needs_allow_remote(
        device: Device, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    # A Unix socket for HTTP does not make the gRPC port private: --host still applies to it.
    r = subprocess.run([sys.executable, "-m", "agent.cli", "serve", "--state-dir",
                        str(device.state), "--model", "digits", "--unix-socket",
                        str(tmp_path / "s.sock"), "--grpc-port", "0", "--host", "0.0.0.0"],
                       env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a loopback address" in r.stderr, r.stderr
