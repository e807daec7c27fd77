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
from registry.atomic import write_json_atomic

FORMAT = "edgetrain.export-report/1"


@dataclass
class Attempt:
    step: str
    """int8 | int8-s8s8 | int8-exclude-<k> | int8-qat | fp16 | fp32"""
    precision: str
    excluded: list[str] = field(default_factory=list)
    """Layers left in float (int8 fallback steps)."""
    recipe: str | None = None
    """INT8 steps: the recipe the file was quantized with (``exporters.int8_recipe``)."""
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
    fallback: str | None = None
    """One line for people when the first step did not win: what it measured and missed,
    and what the winner left in float (``fallback_note``)."""
    int8: dict[str, Any] | None = None
    """INT8 jobs: the first INT8 step's recipe, why it was chosen, and the host's ISA
    (``exporters.cpu_isa``); each attempt names its own recipe."""
    target: str = "onnxruntime"
    checkpoint: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    prune: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    onnx: dict[str, Any] = field(default_factory=dict)
    semi_structured: dict[str, Any] | None = None
    sensitivity: list[dict[str, Any]] | None = None
    """Layers by their output MSE when quantized alone (a classifier's logits, a detector's raw
    head: class logits and box regressions before NMS), worst first."""
    qat: dict[str, Any] | None = None
    """The ``int8-qat`` step's fine-tune, when it ran: steps, final metrics (under fake
    quantization), seconds."""
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


def fallback_note(report: ExportReport) -> str | None:
    """'int8 missed its gates (top-1 drop 19.8 pts > 1 ...); int8-exclude-1 won with conv1 in
    float', or None when the first attempt won (or nothing was tried)."""
    if not report.attempts or report.attempts[0].passed:
        return None
    first = report.attempts[0]
    m = first.measurement
    why = first.error or "; ".join(first.failures) or "failed"
    missed = f"{first.step} missed its gates ({why})"
    if m is not None and not first.error:
        what = "top-1" if m.gate_metric == "acc" else m.gate_metric
        missed = f"{first.step} missed its gates at {what} drop {m.top1_drop_pts:.2f} pts ({why})"
    win = next((a for a in report.attempts if a.passed), None)
    if win is None:
        return f"{missed}; no later step passed either"
    kept = f" with {', '.join(win.excluded)} in float" if win.excluded else ""
    return f"{missed}; {win.step} won{kept}"


def artefact_info(report: ExportReport, winner: Attempt, sha256: str) -> dict[str, Any]:
    """``model.onnx.json``: how the installed file was made, for whoever runs it later."""
    return {
        "format": "edgetrain.artefact-info/1",
        "file": "model.onnx",
        "sha256": sha256,
        "step": winner.step,
        "precision": winner.precision,
        "excluded_layers": list(winner.excluded),
        "int8": _winner_int8(report, winner) if winner.precision == "int8" else None,
        "fallback": fallback_note(report),
        "versions": report.versions,
    }


def _winner_int8(report: ExportReport, winner: Attempt) -> dict[str, Any]:
    """The report's int8 section, for the recipe that won: a fallback step's recipe is not
    the first step's, so neither is its reason."""
    first = report.int8 or {}
    reason = first.get("reason") if winner.recipe == first.get("recipe") else (
        f"fallback: {first.get('recipe')} missed its gates")
    return {**first, "recipe": winner.recipe, "reason": reason}


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
    metric = next((a.measurement.gate_metric for a in report.attempts if a.measurement), "acc")
    head = ["step", "precision", "top-1 %" if metric == "acc" else f"{metric} %", "drop pts",
            "max|dlogit|", "b1 p50/p99 ms",
            f"b{batch} p50/p99 ms", "size MB", "gate"]
    rows = [head] + [_cell(a) for a in report.attempts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    first = next((a.measurement for a in report.attempts if a.measurement), None)
    out = []
    if first is not None:
        what = "top-1" if first.gate_metric == "acc" else first.gate_metric
        out.append(f"FP32 reference {what}: {first.reference_top1 * 100:.2f}% "
                   f"({first.samples} held-out samples)")
        if first.reference_map50 is not None:
            maps = ", ".join(f"{a.step} {a.measurement.map50 * 100:.2f}%"
                             for a in report.attempts
                             if a.measurement and a.measurement.map50 is not None)
            out.append(f"mAP@0.5: FP32 reference {first.reference_map50 * 100:.2f}%; {maps}")
    if report.prune:
        out.append(f"pruning: {report.prune.get('spec')} -> sparsity "
                   f"{report.prune.get('sparsity', 0) * 100:.1f}%, FLOPs "
                   f"{report.model.get('flops_before', 0) / 1e6:.2f}M -> "
                   f"{report.model.get('flops_after', 0) / 1e6:.2f}M")
    if report.int8:
        out.append(f"INT8 recipe: {report.int8['recipe']} ({report.int8['reason']})")
    out += lines
    for a in report.attempts:
        for f in a.failures:
            out.append(f"  {a.step}: {f}")
        if a.error:
            out.append(f"  {a.step}: error: {a.error}")
    if report.fallback:
        out.append(f"fallback: {report.fallback}")
    if report.status == "passed":
        out.append(f"winner: {report.winner} -> {report.artefact}")
    else:
        out.append("no attempt met the gates: nothing installed")
    return "\n".join(out)
