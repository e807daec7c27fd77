"""The device job as an explicit state machine (Mender-style): each step one small function, the
transitions named, every one persisted in the job store before the next step starts.

    pull -> finetune -> [export] -> stage -> health -> commit  -> [upload] -> SUCCEEDED
                                                   \\-> rollback -> FAILED (the reason)

A restart resumes at the first step that is not ``done``: a finished step never runs again;
an interrupted one runs again from its own checkpoint (the fine-tune from its last trainer
checkpoint, the others are idempotent). The active model changes only in ``commit``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agent.jobs.store import JobRecord, JobState, JobStore

log = logging.getLogger(__name__)


class StepFailed(Exception):
    """A step could not do its job; ``code`` is a contract ErrorCode."""

    def __init__(self, step: str, message: str, code: str = "JOB_FAILED") -> None:
        super().__init__(f"{step}: {message}")
        self.step, self.code = step, code


class Canceled(Exception):
    """cancel_requested was seen (at a step boundary or inside the fine-tune)."""


class Suspended(Exception):
    """SIGTERM: the job stays IN_PROGRESS and resumes on the next start (exit 75)."""


class TimedOut(Exception):
    pass


@dataclass
class JobContext:
    store: JobStore
    job_id: str
    state_dir: Path
    spec: Any
    """DeviceJob, DeployJob or RollbackJob (agent.jobs.spec.SPECS)."""
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    deadline: float | None = None
    """time.time() after which the job is TIMED_OUT."""
    on_event: Callable[[str, dict[str, Any]], None] | None = None
    """The progress display's feed: (stage, detail)."""
    current: str = ""
    """The step now running."""

    @property
    def job_dir(self) -> Path:
        return job_dir_of(self.state_dir, self.job_id)

    def event(self, stage: str, *, publish: bool = True, **detail: Any) -> None:
        """Feed the display and (``publish``) the job's progress row, which the daemon
        announces: it names the step now running, so telemetry never shows the last
        fine-tune step while the export runs. The fine-tune child writes its own richer
        progress (optimizer step, loss, governor), so its heartbeats pass publish=False."""
        if publish:
            names = self.spec.planned_steps()
            index = names.index(self.current) + 1 if self.current in names else None
            self.store.set_progress(self.job_id, {
                "id": self.job_id, "stage": self.current or stage,
                "detail": {**_plain(detail), "job_step": index, "job_steps": len(names)},
            })
        if self.on_event is not None:
            self.on_event(stage, detail)


def _plain(detail: dict[str, Any]) -> dict[str, Any]:
    # Step outputs can be large (a whole health report): progress keeps the scalars.
    return {k: v for k, v in detail.items()
            if k == "plan" or isinstance(v, (str, int, float, bool))}


CRASH_ENV = "EDGETRAIN_JOB_CRASH_AT"
"""Fault injection for the restart tests and drills: ``after:STEP`` SIGKILLs the job process
right after STEP is recorded done; ``inside:STEP`` while STEP's child runs (steps.py; the
short stage step's child kills the job itself, child.py)."""


def crash_point(point: str) -> None:
    if point in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def job_dir_of(state_dir: Path, job_id: str) -> Path:
    return Path(state_dir) / "jobs" / job_id


def next_step(spec: BaseModel, outputs: dict[str, dict[str, Any]]) -> str | None:
    """The named transition out of the last finished step (None: the job is over)."""
    order = spec.planned_steps()  # type: ignore[attr-defined]
    for name in order:
        if name == "commit" and not outputs.get("health", {}).get("passed", False):
            return None if "rollback" in outputs else "rollback"
        if name not in outputs:
            return name
    return None


def run(ctx: JobContext, steps: dict[str, Callable[[JobContext], dict[str, Any]]]) -> JobRecord:
    """Drive the job to a terminal state (or raise Suspended); returns the final record."""
    store, jid = ctx.store, ctx.job_id
    for s in store.steps(jid):
        if s.status in ("done", "skipped"):
            ctx.outputs[s.name] = s.outputs or {}
    try:
        while (name := next_step(ctx.spec, ctx.outputs)) is not None:
            if store.cancel_requested(jid) and name not in ("rollback", "upload"):
                raise Canceled(f"canceled before {name}")
            if ctx.deadline is not None and time.time() > ctx.deadline:
                raise TimedOut(f"timeout_s passed before {name}")
            store.step_started(jid, name)
            ctx.current = name
            ctx.event(name, status="started")
            try:
                out = steps[name](ctx)
            except StepFailed as e:
                store.step_failed(jid, name, {"code": e.code, "message": str(e),
                                              "retryable": False})
                raise
            store.step_finished(jid, name, out)
            ctx.outputs[name] = out
            crash_point(f"after:{name}")
            ctx.event(name, status="done", outputs=out)
    except Canceled as e:
        _discard_staged(ctx, steps)
        return store.transition(jid, JobState.CANCELED, error=_err("CANCELED", str(e)))
    except TimedOut as e:
        _discard_staged(ctx, steps)
        return store.transition(jid, JobState.TIMED_OUT, error=_err("TIMED_OUT", str(e), True))
    except StepFailed as e:
        _discard_staged(ctx, steps)
        return store.transition(jid, JobState.FAILED, error=_err(e.code, str(e)),
                                result=outcome(ctx))
    result = outcome(ctx)
    if "rollback" in ctx.outputs:
        return store.transition(jid, JobState.FAILED, result=result,
                                error=_err("JOB_FAILED", f"health: {result['reason']}"))
    return store.transition(jid, JobState.SUCCEEDED, result=result)


def _discard_staged(ctx: JobContext, steps: dict[str, Callable[[JobContext], dict]]) -> None:
    # A staged but uncommitted model never outlives its job.
    if "stage" in ctx.outputs and "commit" not in ctx.outputs and "rollback" not in ctx.outputs:
        ctx.store.step_started(ctx.job_id, "rollback")
        out = steps["rollback"](ctx)
        ctx.store.step_finished(ctx.job_id, "rollback", out)
        ctx.outputs["rollback"] = out


def model_name(ctx: JobContext) -> str:
    spec = ctx.spec
    name = getattr(spec, "model", None) or getattr(spec, "name", None)
    if name is None:  # a rollback of "the only installed model"
        models = sorted(p.name for p in (ctx.state_dir / "models").glob("*") if p.is_dir())
        if len(models) != 1:
            raise StepFailed("switch", f"name is needed: installed models are {models}",
                             code="BAD_ARGS")
        name = models[0]
    return str(name)


def _err(code: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"code": code, "message": message, "retryable": retryable}


def outcome(ctx: JobContext) -> dict[str, Any]:
    """The JobOutcome (contract) of the job so far."""
    o = ctx.outputs
    health = o.get("health", {})
    before = {"eval/acc": health["active"]["accuracy"]} if "active" in health else {}
    after = {"eval/acc": health["staged"]["accuracy"]} if "staged" in health else {}
    if "commit" in o:
        kind, reason = "committed", None
    elif "rollback" in o:
        kind = "rolled_back"
        reason = "; ".join(health.get("failures", [])) or o["rollback"].get("why")
    else:
        kind, reason = "unchanged", None
    if "switch" in o:  # a rollback job
        kind, reason = "rolled_back", ctx.spec.reason or "rollback requested"
    name = model_name(ctx)
    res: dict[str, Any] = {"outcome": kind, "reason": reason, "metrics_before": before,
                           "metrics_after": after}
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
    ft = o.get("finetune")
    res["memory"] = _memory(ft) if ft else None
    res["governor"] = _governor(ft) if ft else None
    res["report_png"] = ft.get("report_png") if ft else None
    return res


EXPORT_FIGURES = ("winner", "int8_drop_pts", "p50_ms_b1", "int8_recipe", "isa", "fallback",
                  "excluded_layers")
"""What the fleet and the summary read of an export: the winner's figures, the recipe and
host, and, when plain INT8 missed its gates, what it measured and what was left in float."""


def _memory(ft: dict[str, Any]) -> dict[str, Any]:
    mem = ft.get("memory") or {}
    plan = mem.get("plan") or {}
    micro = plan.get("micro_batch_size", ft.get("micro_batch_size"))
    return {"peak_tree_mb": mem.get("tree_peak_mb"), "budget_mb": mem.get("budget_mb"),
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
            "state_changes": g.get("events")}
