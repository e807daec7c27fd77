"""export: the fine-tuned model pruned and quantized behind its gates (``exporters``), INT8
first, falling back step by step; what passed is staged and signed with the weights.

Two children, one after the other: ``export_prepare`` (torch: prune, recover, FP32 ONNX,
reference logits) and ``export`` (ONNX Runtime: quantize, gates, install). In one process the
dynamo exporter's and ONNX Runtime's memory added up to 1.2 x the job's budget (48 px resnet
at 450 MB); apart, each stays within it. A resumed job runs both again: the hand-over of a
killed first half is not trusted."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from agent.jobs.protocol import (
    JobContext,
    StepContext,
    StepFailed,
    child_main,
    run_child,
    step_context,
)


def refusal(ctx: JobContext) -> str | None:
    """Why this job's model cannot be exported (its task, or its detector family, has no
    export yet: a segmenter, an FCOS), or None. Read from the pulled upstream's manifest,
    torch-free: the fine-tune step asks before it trains, so such a job fails at once,
    BAD_ARGS, instead of after its training."""
    from agent.jobs.steps.pull import pulled_model
    from exporters.job import unexportable

    if not ctx.spec.steps.export:
        return None
    model = pulled_model(ctx)
    why = unexportable(model.task, model.name)
    return None if why is None else f"steps.export: {ctx.spec.model} is {why}"


def run(ctx: JobContext) -> dict[str, Any]:
    why = refusal(ctx)
    if why is not None:
        raise StepFailed("export", why, code="BAD_ARGS")
    context = step_context(ctx)
    run_child(ctx, __name__, "export_prepare", context)
    out = run_child(ctx, __name__, "export", context)
    if out.get("status") != "passed":
        raise StepFailed("export", f"no export step met the gates: {out.get('fallback_reason')}")
    return out


def bounded_by_plan(export: dict[str, Any], micro: int | None) -> dict[str, Any]:
    """The export's batches (calibration, recovery fine-tune, every scoring pass) no larger
    than the micro-batch the fine-tune's memory plan fitted into the job's budget: an
    inference or calibration batch costs less than a training step of the same size, so the
    export stays under the budget the fine-tune was planned for."""
    if not micro:
        return export
    out = {**export}
    for part in ("calibration", "recovery", "gates"):
        section = dict(out.get(part) or {})
        section["batch_size"] = min(int(section.get("batch_size") or micro), micro)
        out[part] = section
    return out


def _job(c: StepContext) -> Any:
    from exporters.job import ExportJob

    return ExportJob.model_validate(bounded_by_plan({
        **c.spec["export"], "checkpoint": str(c.finetuned), "out_dir": str(c.job_dir / "export"),
    }, c.micro_batch))


def child_prepare(c: StepContext) -> dict[str, Any]:
    from agent.finetune.cold_pages import drop_cold_pages
    from exporters.prepare import prepare

    drop_cold_pages()  # torch's and the exporter's start-up code: agent.finetune.cold_pages
    p = prepare(_job(c))
    return {"fp32": str(p.fp32_path), "held_out": len(p.inputs), "calibration": len(p.calib)}


def child(c: StepContext) -> dict[str, Any]:
    from agent.finetune.cold_pages import drop_cold_pages
    from exporters.pipeline import quantize_and_gate

    drop_cold_pages()  # ONNX Runtime's start-up code
    job = _job(c)
    report = quantize_and_gate(job)
    out: dict[str, Any] = {
        "status": report.status, "winner": report.winner, "artefact": None,
        "fallback_reason": report.fallback_reason, "fallback": report.fallback,
        "isa": ((report.int8 or {}).get("isa") or {}).get("label"),
        "seconds": round(report.seconds, 2),
    }
    if report.status == "passed":
        out["artefact"] = str(job.out_dir / "model.onnx")
        # The file and how it was made (recipe, ISA, excluded layers): staged and signed together.
        out["artefacts"] = [out["artefact"], str(job.out_dir / "model.onnx.json")]
        # On a TensorRT target the engine built on this device, with the TensorRT version and
        # GPU that built it: staged beside the ONNX file, what serves where it loads.
        out["artefacts"] += [str(p) for p in (job.out_dir / "model.engine",
                                              job.out_dir / "model.engine.json") if p.is_file()]
        first = report.attempts[0].measurement if report.attempts else None
        winner = next(a for a in report.attempts if a.passed)
        out["excluded_layers"] = list(winner.excluded)
        out["int8_recipe"] = winner.recipe  # what serves: a fallback step may have changed it
        win = winner.measurement
        if win is not None:
            out["int8_drop_pts"] = getattr(win, "top1_drop_pts", None)
            out["p50_ms_b1"] = getattr(getattr(win, "latency_b1", None), "p50_ms", None)
            out["gate_metric"] = win.gate_metric
            if win.map50 is not None:  # a detector: mAP@0.5 beside mAP@0.5:0.95
                out["map"], out["map50"] = win.top1, win.map50
                out["map50_drop_pts"] = win.map50_drop_pts
        if first is not None:
            out["reference_top1"] = getattr(first, "reference_top1", None)
            if first.reference_map50 is not None:
                out["reference_map50"] = first.reference_map50
    return out


CHILDREN: dict[str, Callable[[StepContext], dict[str, Any]]] = {
    "export_prepare": child_prepare, "export": child}
"""This step's torch halves by name: ``python -m agent.jobs.steps.export NAME JOB_DIR``
(:func:`agent.jobs.protocol.child_main`)."""

if __name__ == "__main__":
    sys.exit(child_main(CHILDREN))
