"""A detector served over the Open Inference Protocol: a real (tiny) detector-shaped ONNX model
with EfficientNMS-shaped outputs (``num_detections`` INT32, ``boxes`` FP32, ``scores`` FP32,
``classes`` INT32), installed in a real signed device slot, answered by real servers on
loopback (in-process HTTP; ``agentctl serve`` with gRPC) and compared with ONNX Runtime's own
run of the same file; a hot swap of the detector under load fails no request."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.runtime.active_model import ActiveModel
from agent.runtime.engines import engine_for
from agent.runtime.oip import OipServer
from tests.agent.runtime.conftest import MODEL, Device
from tests.agent.runtime.detector_onnx import (
    DATATYPES,
    INPUT_SHAPE,
    OUTPUTS,
    SHAPES,
    images,
    reference,
    tiny_detector_onnx,
)
from tests.agent.runtime.test_active_model import ListSpool, wait_for
from tests.agent.runtime.test_oip import call
from tests.agent.runtime.test_oip_grpc import agentctl_serve

METADATA_OUTPUTS = [{"name": n, "datatype": DATATYPES[n], "shape": SHAPES[n]} for n in OUTPUTS]
NUMPY = {"FP32": "<f4", "INT32": "<i4"}


@pytest.fixture
def detector(device: Device, tmp_path: Path) -> dict[int, Path]:
    """Two versions of the detector; version 1 committed in the device's slot."""
    files = {v: tiny_detector_onnx(tmp_path / "det" / f"v{v}.onnx", v) for v in (1, 2)}
    device.install(1, onnx_from=files[1])
    return files


def assert_outputs(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Same names in the same order, same dtypes and shapes; integers exactly, floats to
    float32 rounding (the server's session may split work across threads differently)."""
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


def from_json(outputs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    out = {}
    for o in outputs:
        if DATATYPES[o["name"]] == "INT32":  # integers in JSON, not floats
            assert all(type(v) is int for v in o["data"]), o["name"]
        out[o["name"]] = np.array(o["data"], NUMPY[o["datatype"]]).astype(
            NUMPY[o["datatype"]][1:]).reshape(o["shape"])
    return out


def infer_json(x: np.ndarray, **body: Any) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}], **body}).encode()


def test_the_engine_declares_and_returns_every_typed_output(
        device: Device, detector: dict[int, Path]) -> None:
    active = device.slots.active()
    assert active is not None
    engine = engine_for(active.path)
    assert [o.metadata() for o in engine.outputs] == METADATA_OUTPUTS
    assert (engine.output_name, engine.output_shape) == ("num_detections", (-1, 1))
    x = images(3)
    got = engine(x)
    assert_outputs(got, reference(detector[1], x))
    for i in range(3):  # a batch is its samples run one by one, output by output
        alone = engine(x[i:i + 1])
        for name in OUTPUTS:
            np.testing.assert_array_equal(alone[name], got[name][i:i + 1])
    with pytest.raises(TypeError, match=r"4 outputs .*read each by name"):
        np.asarray(got)
    engine.close()


def test_active_model_infers_every_output_and_records_without_logits(
        device: Device, detector: dict[int, Path]) -> None:
    spool = ListSpool()
    with ActiveModel(device.state, MODEL, poll_s=0.02, spool=spool) as model:
        x = images(2, seed=3)
        outputs, version = model.infer_versioned(x)
        assert version == "1"
        assert_outputs(outputs, reference(detector[1], x))
        with pytest.raises(TypeError, match="4 outputs"):
            model.predict(x)  # a classifier's call: a detector has no one logits array
        assert model.record(x, label=2) == 1  # no argmax label, no confidence: no logits
        kept, label, logits = spool.items[0]
        assert kept is x and label == 2 and logits is None
        assert model.stats().failed == 0


@pytest.fixture
def http_detector(device: Device, detector: dict[int, Path]
                  ) -> Iterator[tuple[OipServer, ListSpool]]:
    spool = ListSpool()
    with ActiveModel(device.state, MODEL, poll_s=0.02, spool=spool) as model, \
            OipServer(model, port=0) as server:
        server.start()
        yield server, spool


def test_http_json_and_binary_answers_equal_onnx_runtime(
        http_detector: tuple[OipServer, ListSpool], detector: dict[int, Path]) -> None:
    server, spool = http_detector
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    status, meta = call(c, "GET", f"/v2/models/{MODEL}")
    assert status == 200 and meta["outputs"] == METADATA_OUTPUTS
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, *INPUT_SHAPE]}]

    x = images(3, seed=5)
    want = reference(detector[1], x)
    status, out = call(c, "POST", f"/v2/models/{MODEL}/infer", infer_json(x))
    assert status == 200 and out["model_version"] == "1"
    assert [(o["name"], o["datatype"], o["shape"]) for o in out["outputs"]] == [
        (n, DATATYPES[n], list(want[n].shape)) for n in OUTPUTS]
    assert_outputs(from_json(out["outputs"]), want)

    # A subset, in the order asked for.
    status, out = call(c, "POST", f"/v2/models/{MODEL}/infer", infer_json(
        x, outputs=[{"name": "classes"}, {"name": "num_detections"}]))
    assert status == 200 and [o["name"] for o in out["outputs"]] == ["classes", "num_detections"]
    assert_outputs(from_json(out["outputs"]), {n: want[n] for n in ("classes", "num_detections")})

    # Binary extension: raw little-endian tensors after the JSON header, in the order asked
    # for; one output raw, another as JSON, in one answer.
    body = infer_json(x, outputs=[{"name": "scores"},
                                  {"name": "classes", "parameters": {"binary_data": True}},
                                  {"name": "boxes", "parameters": {"binary_data": True}}])
    c.request("POST", f"/v2/models/{MODEL}/infer", body)
    r = c.getresponse()
    raw = r.read()
    head_len = int(r.getheader("Inference-Header-Content-Length"))
    head = json.loads(raw[:head_len])
    assert r.status == 200 and [o["name"] for o in head["outputs"]] == ["scores", "classes",
                                                                        "boxes"]
    got, at = {}, head_len
    for o in head["outputs"]:
        if "data" in o:
            got.update(from_json([o]))
            continue
        size = o["parameters"]["binary_data_size"]
        got[o["name"]] = np.frombuffer(raw[at:at + size], NUMPY[o["datatype"]]).astype(
            NUMPY[o["datatype"]][1:]).reshape(o["shape"])
        at += size
    assert at == len(raw)
    assert_outputs(got, {n: want[n] for n in ("scores", "classes", "boxes")})

    status, err = call(c, "POST", f"/v2/models/{MODEL}/infer",
                       infer_json(x, outputs=[{"name": "logits"}]))
    assert status == 400 and "unknown output 'logits'" in err["error"]
    assert all(n in err["error"] for n in OUTPUTS)

    # Recording a detector's sample: stored without logits.
    status, out = call(c, "POST", f"/v2/models/{MODEL}/record", infer_json(x))
    assert status == 200 and out["stored"] == 1 and spool.items[0][2] is None
    c.close()


def test_tritonclient_http_binary_tensors(http_detector: tuple[OipServer, ListSpool],
                                          detector: dict[int, Path]) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    server, _ = http_detector
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    x = images(2, seed=7)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)  # binary in; outputs binary (the client's default)
    res = client.infer(MODEL, [inp])
    assert_outputs({n: res.as_numpy(n) for n in OUTPUTS}, reference(detector[1], x))
    res = client.infer(MODEL, [inp], outputs=[httpclient.InferRequestedOutput("num_detections"),
                                              httpclient.InferRequestedOutput("boxes")])
    assert [o["name"] for o in res.get_response()["outputs"]] == ["num_detections", "boxes"]
    assert res.as_numpy("scores") is None
    want = reference(detector[1], x)
    assert_outputs({n: res.as_numpy(n) for n in ("num_detections", "boxes")},
                   {n: want[n] for n in ("num_detections", "boxes")})
    client.close()


def test_agentctl_serve_grpc_answers_and_a_hot_swap_under_load_fails_nothing(
        device: Device, detector: dict[int, Path], tmp_path: Path,
        subprocess_env: dict[str, str]) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    x = images(2, seed=11)
    expected = {v: reference(path, x) for v, path in detector.items()}
    assert not np.allclose(expected[1]["boxes"], expected[2]["boxes"])  # tellable apart
    with agentctl_serve(device, tmp_path, subprocess_env) as serve:
        c, h = serve.client(), serve.http()
        gmeta = c.get_model_metadata(MODEL, as_json=True)
        assert [{**t, "shape": [int(d) for d in t["shape"]]} for t in gmeta["outputs"]] \
            == METADATA_OUTPUTS == call(h, "GET", f"/v2/models/{MODEL}")[1]["outputs"]
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = c.infer(MODEL, [inp])
        assert [o.name for o in res.get_response().outputs] == list(OUTPUTS)
        assert_outputs({n: res.as_numpy(n) for n in OUTPUTS}, expected[1])
        res = c.infer(MODEL, [inp], outputs=[grpcclient.InferRequestedOutput("scores")])
        assert [o.name for o in res.get_response().outputs] == ["scores"]
        np.testing.assert_allclose(res.as_numpy("scores"), expected[1]["scores"], rtol=1e-6)

        # Hot swap under load: one gRPC and one HTTP client send back to back while version
        # 2 is committed; every request answered, each answer that of the version it names.
        stop, failures = threading.Event(), []
        seen: dict[str, list[int]] = {"grpc": [], "http": []}

        def check(version: str, got: dict[str, np.ndarray]) -> int:
            assert_outputs(got, expected[int(version)])
            return int(version)

        def grpc_load() -> None:
            client = serve.client()
            while not stop.is_set():
                try:
                    r = client.infer(MODEL, [inp])
                    seen["grpc"].append(check(r.get_response().model_version,
                                              {n: r.as_numpy(n) for n in OUTPUTS}))
                except Exception as e:  # collected: an assert in a thread would be lost
                    failures.append(e)
            client.close()

        def http_load() -> None:
            conn = serve.http()
            while not stop.is_set():
                try:
                    status, out = call(conn, "POST", f"/v2/models/{MODEL}/infer",
                                       infer_json(x))
                    assert status == 200, out
                    seen["http"].append(check(out["model_version"], from_json(out["outputs"])))
                except Exception as e:
                    failures.append(e)

        threads = [threading.Thread(target=f) for f in (grpc_load, http_load)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: all(len(s) >= 3 for s in seen.values()) or bool(failures),
                     timeout_s=20, what="both clients answered by version 1")
            device.install(2, onnx_from=detector[2])
            wait_for(lambda: all(s and s[-1] == 2 for s in seen.values()) or bool(failures),
                     timeout_s=20, what="both clients answered by version 2")
            time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        assert failures == []
        for s in seen.values():
            assert s == sorted(s) and s[0] == 1 and s[-1] == 2, s
        c.close()
        h.close()
