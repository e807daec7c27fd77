from __future__ import annotations

import json
from pathlib import Path

from exporters.gates import GateMeasurement
from exporters.report import Attempt, ExportReport, render_table, write_report
from exporters.runtime import Latency


def _m(top1: float) -> GateMeasurement:
    return GateMeasurement(top1=top1, reference_top1=0.98, top1_drop_pts=(0.98 - top1) * 100,
                           max_abs_logit_delta=0.3, latency_b1=Latency(1, 0.2, 0.3, 50),
                           latency_batch=Latency(32, 2.0, 2.5, 50), size_mb=0.1, samples=359)


def _report() -> ExportReport:
    return ExportReport(
        status="passed", winner="fp16", artefact="model.onnx",
        attempts=[
            Attempt("int8", "int8", error="RuntimeError: calibration failed"),
            Attempt("fp16", "fp16", artefact="fp16.onnx", passed=True, measurement=_m(0.975)),
        ],
    )


def test_table_shows_every_attempt_and_the_winner() -> None:
    text = render_table(_report())
    assert "FP32 reference top-1: 98.00% (359 held-out samples)" in text
    lines = text.splitlines()
    assert any(line.startswith("int8") and line.endswith("ERROR") for line in lines)
    assert any(line.startswith("fp16") and "97.50" in line and "+0.50" in line for line in lines)
    assert "int8: error: RuntimeError: calibration failed" in text
    assert lines[-1] == "winner: fp16 -> model.onnx"


def test_json_report_round_trips(tmp_path: Path) -> None:
    write_report(_report(), tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["format"] == "edgetrain.export-report/1" and data["winner"] == "fp16"
    assert data["attempts"][1]["measurement"]["latency_batch"]["p50_ms"] == 2.0
    assert data["attempts"][0]["measurement"] is None
