"""A detector's device job with its export on: fine-tuned, exported with NMS in the graph,
quantized to INT8 behind gates by mAP, the winning ONNX file staged, signed and health-checked
in ONNX Runtime (the runtime that serves it), then committed."""

from __future__ import annotations

import json

import onnx
import pytest

from agent.jobs.store import JobState
from exporters.detection.outputs import OUTPUT_NAMES
from tests.agent.jobs.detection.conftest import DetectorDevice
from tests.agent.jobs.detection.test_detection_job import run_job

pytestmark = pytest.mark.slow


def test_a_detector_job_exports_int8_gated_by_map_and_serves_it(
        detector_device: DetectorDevice) -> None:
    dev = detector_device
    dev.install()
    # A tiny detector's mAP is a few points and moves by a few between runtimes: the gates
    # here allow 5 points (the health check's drop too); the figures are what is asserted.
    rec, out = run_job(
        dev, "x1", steps={"export": True},
        export={"precision": "int8", "calibration": {"samples": 8},
                "gates": {"latency_iters": 2, "latency_warmup": 0, "max_top1_drop_pts": 5.0,
                          "max_map50_drop_pts": 5.0},
                "fallback": {"max_excluded_layers": 1, "sensitivity_samples": 8}},
        health={"max_accuracy_drop_pts": 5.0})
    assert rec.state is JobState.SUCCEEDED, (rec.error, out)
    ex = out["export"]
    assert ex["status"] == "passed" and ex["winner"] in ("int8", "int8-exclude-1", "fp16",
                                                          "fp32"), ex
    assert ex["gate_metric"] == "map" and 0 <= ex["map50"] <= 1
    assert ex["map50_drop_pts"] is not None and ex["reference_map50"] is not None
    report = json.loads((dev.state / "jobs/x1/export/report.json").read_text())
    first = report["attempts"][0]
    assert first["step"] == "int8" and first["measurement"]["gate_metric"] == "map"
    assert first["measurement"]["map50"] is not None
    won = next(a for a in report["attempts"] if a["passed"])
    assert won["step"] == ex["winner"] and won["measurement"]["map50_drop_pts"] <= 5.0
    # The committed version carries the exported file: NMS in the graph, the four outputs.
    from agent.storage.slots import ModelSlots

    active = ModelSlots(dev.state, "det").active()
    assert active is not None and active.version == rec.result["model"]["version"]
    graph = onnx.load(str(active.path / "artefacts" / "model.onnx")).graph
    assert [o.name for o in graph.output] == list(OUTPUT_NAMES)
    assert any(n.op_type == "NonMaxSuppression" for n in graph.node)
    if ex["winner"].startswith("int8"):
        assert any(n.op_type == "QuantizeLinear" for n in graph.node)
    # The health check ran the staged model in ONNX Runtime, scored by mAP like the torch one.
    h = out["health"]
    assert h["gate_metric"] == "map" and h["passed"], h
    assert h["staged"]["runtime"].startswith("onnxruntime") and h["active"]["runtime"] == "torch"
    assert h["staged"]["accuracy"] is None and h["staged"]["metrics"]["map50"] is not None
    assert rec.result["export"]["winner"] == ex["winner"]
