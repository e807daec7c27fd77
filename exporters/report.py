"""The export report: what was tried, what each attempt measured, which one won and why.

Written as JSON (``report.json``, atomically) for the agent to forward, and rendered as a
table for people.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from exporters.gates import GateMeasurement
from hpc_core.atomic import write_json_atomic

FORMAT = "edgetrain.export-report/1"


@dataclass
class Attempt:
    step: str
    """int8 | int8-exclude-<k> | fp16 | fp32"""
    precision: str
    excluded: list[str] = field(default_factory=list)
    """Layers left in float (int8 fallback steps)."""
    artefact: str | None = None
    passed: bool = False
    failures: list[str] = field(default_factory=list)
    measurement: GateMeasurement | None = None
    qdq_violations: list[str] = field(default_factory=list)
    error: str | None = None
    """Why the attempt produced no artefact (build or quantization error)."""
    seconds: float = 0.0


@dataclass
class ExportReport:
    status: str = "failed"
    """passed: an attempt met every gate and was installed as the output; failed: none did."""
    winner: str | None = None
    """The step whose artefact is the output."""
    artefact: str | None = None
    artefact_sha256: str | None = None
    fallback_reason: str | None = None
    """Why earlier steps were rejected, when the winner is not the first step."""
    target: str = "onnxruntime"
    checkpoint: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    prune: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    onnx: dict[str, Any] = field(default_factory=dict)
    semi_structured: dict[str, Any] | None = None
    sensitivity: list[dict[str, Any]] | None = None
    attempts: list[Attempt] = field(default_factory=list)
    job: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    try:
        import tensorrt

        out["tensorrt"] = tensorrt.__version__
    except ImportError:
        pass
    return out


def write_report(report: ExportReport, path: Path) -> None:
    write_json_atomic(Path(path), report.to_dict())


def _cell(a: Attempt) -> list[str]:
    m = a.measurement
    result = "PASS" if a.passed else ("ERROR" if a.error else "fail")
    if m is None:
        return [a.step, a.precision, "-", "-", "-", "-", "-", "-", result]
    return [
        a.step,
        a.precision,
        f"{m.top1 * 100:.2f}",
        f"{m.top1_drop_pts:+.2f}",
        f"{m.max_abs_logit_delta:.3g}",
        f"{m.latency_b1.p50_ms:.3f}/{m.latency_b1.p99_ms:.3f}",
        f"{m.latency_batch.p50_ms:.2f}/{m.latency_batch.p99_ms:.2f}",
        f"{m.size_mb:.3f}",
        result,
    ]


def render_table(report: ExportReport) -> str:
    batch = next(
        (a.measurement.latency_batch.batch for a in report.attempts if a.measurement), "N"
    )
    head = ["step", "precision", "top-1 %", "drop pts", "max|dlogit|", "b1 p50/p99 ms",
            f"b{batch} p50/p99 ms", "size MB", "gate"]
    rows = [head] + [_cell(a) for a in report.attempts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    first = next((a.measurement for a in report.attempts if a.measurement), None)
    out = []
    if first is not None:
        out.append(f"FP32 reference top-1: {first.reference_top1 * 100:.2f}% "
                   f"({first.samples} held-out samples)")
    if report.prune:
        out.append(f"pruning: {report.prune.get('spec')} -> sparsity "
                   f"{report.prune.get('sparsity', 0) * 100:.1f}%, FLOPs "
                   f"{report.model.get('flops_before', 0) / 1e6:.2f}M -> "
                   f"{report.model.get('flops_after', 0) / 1e6:.2f}M")
    out += lines
    for a in report.attempts:
        for f in a.failures:
            out.append(f"  {a.step}: {f}")
        if a.error:
            out.append(f"  {a.step}: error: {a.error}")
    if report.status == "passed":
        out.append(f"winner: {report.winner} -> {report.artefact}")
    else:
        out.append("no attempt met the gates: nothing installed")
    return "\n".join(out)
