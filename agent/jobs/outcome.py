"""What a finished device job reports: the contract's JobOutcome (committed, rolled back or
unchanged, the model before and after, its task's gate metric before and after: ``eval/acc``
of a classifier, ``eval/map`` of a detector, named in ``gate_metric``) plus the figures the
fleet and the summary read (export, health, memory, governor)."""

from __future__ import annotations

import math
from typing import Any

from agent.jobs.proctree import MEASURE
from agent.jobs.protocol import JobContext

EXPORT_FIGURES = ("winner", "int8_drop_pts", "p50_ms_b1", "int8_recipe", "isa", "fallback",
                  "excluded_layers", "map50", "map50_drop_pts")
"""What the fleet and the summary read of an export: the winner's figures (a detector's
mAP@0.5 and its drop below the FP32 model's), the recipe and host, and, when plain INT8 missed
its gates, what it measured and what was left in float."""


def outcome(ctx: JobContext) -> dict[str, Any]:
    """The JobOutcome (contract) of the job so far: it says what happened, never more (a
    commit is reported only once the step recorded the switch)."""
    o = ctx.outputs
    health = o.get("health", {})
    key = f"eval/{health.get('gate_metric', 'acc')}"  # a job recorded before the seam: top-1
    before = _metric(key, health.get("active"))
    after = _metric(key, health.get("staged"))
    if "commit" in o:
        kind, reason = "committed", None
    elif "rollback" in o:
        kind = "rolled_back"
        reason = "; ".join(health.get("failures", [])) or o["rollback"].get("why")
    else:
        kind, reason = "unchanged", None
    if "switch" in o:  # a rollback job
        kind, reason = "rolled_back", ctx.spec.reason or "rollback requested"
    ev = o.get("evaluate")
    if ev is not None:  # an evaluate job: the baseline before, the candidate after
        key = f"eval/{ev.get('gate_metric', 'acc')}"
        before = _metric(key, ev.get("baseline"))
        after = _metric(key, ev)
    name = ctx.model_name()
    res: dict[str, Any] = {"outcome": kind, "reason": reason, "metrics_before": before,
                           "metrics_after": after}
    if before or after:
        res["gate_metric"] = key
    pull = o.get("pull")
    if pull:
        res["previous_model"] = {"name": name, "version": pull["active"] or pull["version"]}
    if "commit" in o:
        res["model"] = {"name": name, "version": o["commit"]["version"],
                        "slot": o["commit"]["slot"]}
    elif "switch" in o:
        res["model"] = {"name": name, "version": o["switch"]["version"],
                        "slot": o["switch"]["slot"]}
        res["previous_model"] = {"name": name, "version": o["switch"]["previous"]}
    elif pull:
        res["model"] = res["previous_model"]
    if "upload" in o:
        res["uploaded"] = {"name": name, "version": o["upload"]["version"],
                           "parent": o["upload"]["parent"]}
    # Extra figures for the fleet and the summary (JobOutcome allows extra keys).
    res["export"] = {k: o["export"].get(k) for k in EXPORT_FIGURES} if "export" in o else None
    res["health"] = health or None
    res["evaluation"] = ev
    ft = o.get("finetune")
    res["memory"] = _memory(ft, o) if ft else None
    res["governor"] = _governor(ft) if ft else None
    res["report_png"] = ft.get("report_png") if ft else None
    return res


def _metric(key: str, figures: dict[str, Any] | None) -> dict[str, float]:
    """``{key: the gate metric}`` of one model's figures; empty when it has none or it is
    undefined (``nan``: no ground truth; the health check failed it already)."""
    if not figures:
        return {}
    v = figures.get("metric", figures.get("accuracy"))
    return {} if v is None or math.isnan(v) else {key: float(v)}


def _memory(ft: dict[str, Any], outputs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The budget and the whole job's peak: the highest of every step's process tree (the
    machine measures each), and which step reached it."""
    mem = ft.get("memory") or {}
    plan = mem.get("plan") or {}
    micro = plan.get("micro_batch_size", ft.get("micro_batch_size"))
    steps = {k: v["tree_peak_mb"] for k, v in outputs.items()
             if isinstance(v.get("tree_peak_mb"), (int, float))}
    top = max(steps, key=steps.__getitem__) if steps else None
    return {"peak_tree_mb": steps[top] if top else None, "peak_step": top,
            "steps_peak_mb": steps, "measured": MEASURE, "budget_mb": mem.get("budget_mb"),
            "micro_batch": micro,
            "accumulation": plan.get("accumulation_steps", ft.get("accumulation_steps")),
            "planned": bool(plan)}


def _governor(ft: dict[str, Any]) -> dict[str, Any]:
    """The pacing summary; all None when the fine-tune ran without sensors (no governor)."""
    g = ft.get("governor") or {}
    held = [g[k] for k in ("paced_s", "waited_s") if g.get(k) is not None]
    return {"max_temp_c": ft.get("max_temp_c"), "target_c": ft.get("target_c"),
            "throttled_s": round(sum(held), 2) if held else None,
            "time_above_target_s": g.get("time_above_target_s"),
            "state_changes": g.get("events"),
            # Training given to the application (its p99 over the SLO), and the worst p99 seen.
            "yielded_s": g.get("yielded_s"), "fewer_threads_s": g.get("fewer_threads_s"),
            "worst_app_p99_ms": g.get("worst_app_p99_ms")}
