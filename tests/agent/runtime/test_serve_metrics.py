"""agentctl serve's GET /metrics: Triton's inference counters, HTTP and gRPC counted together,
per version, read back with prometheus_client's own parser."""

from __future__ import annotations

import http.client
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.runtime.conftest import INPUT_SHAPE, Device
from tests.agent.runtime.test_oip import call, infer_body
from tests.agent.runtime.test_oip_grpc import agentctl_serve
from tests.support.grafana import queried_metrics

grpcclient = pytest.importorskip("tritonclient.grpc")


def scrape(conn: http.client.HTTPConnection) -> dict[tuple[str, tuple[tuple[str, str], ...]],
                                                      float]:
    """Every sample of GET /metrics as {(name, sorted labels): value}."""
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200 and r.getheader("Content-Type", "").startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_http_and_grpc_per_version_under_tritons_names(
        device: Device, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    device.install(1)
    with agentctl_serve(device, tmp_path, subprocess_env) as serve:
        http = serve.http()
        v1 = (("model", "digits"), ("version", "1"))
        # Nothing answered yet: the families are there, empty; the histogram has no series.
        assert not [k for k in scrape(http) if k[0].startswith("nv_")]
        assert call(http, "POST", "/v2/models/digits/infer", infer_body([3, *INPUT_SHAPE]))[0] \
            == 200
        assert call(http, "POST", "/v2/models/digits/infer", infer_body([1, *INPUT_SHAPE]))[0] \
            == 200
        status, err = call(http, "POST", "/v2/models/digits/infer", infer_body([2, 1, 7, 7]))
        assert status == 400, err
        x = np.zeros((2, *INPUT_SHAPE), np.float32)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert serve.client().infer("digits", [inp]).as_numpy("logits").shape == (2, 10)

        m = scrape(http)
        assert m[("nv_inference_request_success", v1)] == 3  # two HTTP, one gRPC
        assert m[("nv_inference_count", v1)] == 6  # batches of 3, 1 and 2
        assert m[("nv_inference_exec_count", v1)] == 3
        assert m[("nv_inference_request_failure", (*v1[:1], ("reason", "REJECTED"),
                                                   v1[1]))] == 1
        request_us = m[("nv_inference_request_duration_us", v1)]
        compute_us = m[("nv_inference_compute_infer_duration_us", v1)]
        assert request_us > compute_us > 0
        hist = "edgetrain_inference_request_duration_seconds"
        assert m[(f"{hist}_count", v1)] == 3
        assert m[(f"{hist}_bucket", (("le", "+Inf"), *v1))] == 3
        assert 0 < m[(f"{hist}_sum", v1)] <= request_us / 1e6 + 1e-9
        # The repository's Grafana dashboard queries no serving metric that is not here.
        queried = queried_metrics("nv_inference_") | queried_metrics("edgetrain_inference_")
        assert len(queried) >= 6 and queried <= {k[0] for k in m}, queried

        device.install(2)  # a commit: the next answers count under version 2
        deadline = time.monotonic() + 20
        while call(http, "GET", "/v2/models/digits")[1]["versions"] != ["2"]:
            assert time.monotonic() < deadline, "version 2 never served"
            time.sleep(0.1)
        assert call(http, "POST", "/v2/models/digits/infer", infer_body([1, *INPUT_SHAPE]))[0] \
            == 200
        m = scrape(http)
        assert m[("nv_inference_request_success", (("model", "digits"), ("version", "2")))] == 1
        assert m[("nv_inference_request_success", v1)] == 3
        assert call(http, "POST", "/metrics", b"")[0] == 405
