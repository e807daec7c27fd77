"""The device job as an explicit state machine (Mender-style): a table of
``(state, event) -> state`` per job type, one step function per state (:data:`WORKER_STEPS`,
from ``agent.jobs.steps``), every transition persisted in the job store before it is
announced.

    finetune: pull -> finetune -> [export] -> stage -> health -passed-> commit -> [upload] -> done
                                                             \\-failed-> rollback -> rolled back
    deploy:   pull -> [personalize] -> stage -> health -passed-> commit -> done
                                                      \\-failed-> rollback -> rolled back
    rollback: switch -> done
    evaluate: pull -> evaluate -> done   (a registry version scored, never installed)

Events: ``done`` (the step finished), ``skip`` (the job's spec leaves an optional step out),
``passed`` / ``failed`` (health's verdict). A restart replays the recorded steps through the
table and resumes at the first state not recorded: a finished step never runs again; an
interrupted one runs again from its own checkpoint (the fine-tune from its last trainer
checkpoint, the others are idempotent). The active model changes only in ``commit``.

Adding a job type is one entry in :data:`TRANSITIONS` (and its spec in ``agent.jobs.spec``)
plus its step modules; README "Architecture" walks through one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.jobs.outcome import outcome
from agent.jobs.proctree import TreePeak
from agent.jobs.protocol import (
    Canceled,
    JobContext,
    StepFailed,
    TimedOut,
    crash_point,
)
from agent.jobs.steps import (
    commit,
    evaluate,
    export,
    finetune,
    health,
    personalize,
    pull,
    stage,
    switch,
    upload,
)
from agent.jobs.store import JobRecord, JobState

log = logging.getLogger(__name__)

START = "start"
DONE = "done"
"""Terminal: the job succeeded."""
ROLLED_BACK = "rolled_back"
"""Terminal: the staged model failed its health check and was dropped: the job FAILED."""
ENDS = frozenset({DONE, ROLLED_BACK})

Table = dict[tuple[str, str], str]

TRANSITIONS: dict[str, Table] = {
    "finetune": {
        (START, "begin"): "pull",
        ("pull", "done"): "finetune",
        ("finetune", "done"): "export",
        ("export", "done"): "stage",
        ("export", "skip"): "stage",
        ("stage", "done"): "health",
        ("health", "passed"): "commit",
        ("health", "failed"): "rollback",
        ("commit", "done"): "upload",
        ("upload", "done"): DONE,
        ("upload", "skip"): DONE,
        ("rollback", "done"): ROLLED_BACK,
    },
    "deploy": {
        (START, "begin"): "pull",
        ("pull", "done"): "personalize",
        ("personalize", "done"): "stage",
        ("personalize", "skip"): "stage",
        ("stage", "done"): "health",
        ("health", "passed"): "commit",
        ("health", "failed"): "rollback",
        ("commit", "done"): DONE,
        ("rollback", "done"): ROLLED_BACK,
    },
    "rollback": {
        (START, "begin"): "switch",
        ("switch", "done"): DONE,
    },
    "evaluate": {
        (START, "begin"): "pull",
        ("pull", "done"): "evaluate",
        ("evaluate", "done"): DONE,
    },
}
"""Job type -> its transitions. A state is a step name (:data:`WORKER_STEPS`) or one of
:data:`ENDS`."""

WORKER_STEPS: dict[str, Callable[[JobContext], dict[str, Any]]] = {
    "pull": pull.run, "finetune": finetune.run, "export": export.run, "stage": stage.run,
    "health": health.run, "commit": commit.run, "rollback": commit.rollback,
    "personalize": personalize.run,
    "upload": upload.run, "switch": switch.run, "evaluate": evaluate.run,
}
"""State -> the function the worker runs for it (``agent.jobs.steps``: one module per step,
which also holds the step's torch half)."""

NOT_CANCELABLE = frozenset({"rollback", "upload"})
"""Steps that still run after a cancel: dropping what was staged, sending what was committed."""


def event_of(state: str, outputs: dict[str, Any]) -> str:
    """The event a finished step raises: health's verdict, ``done`` for every other."""
    if state == "health":
        return "passed" if outputs.get("passed", False) else "failed"
    return "done"


def next_state(table: Table, spec: Any, outputs: dict[str, dict[str, Any]]) -> str:
    """Replay the recorded steps through ``table``: the first state not recorded (or an
    end). A step the spec leaves out raises ``skip``."""
    skipped = spec.skipped_steps()
    state = table[(START, "begin")]
    while state not in ENDS:
        if state in outputs:
            event = event_of(state, outputs[state])
        elif state in skipped:
            event = "skip"
        else:
            return state
        state = table[(state, event)]
    return state


def planned_steps(table: Table, spec: Any) -> list[str]:
    """The steps a job runs when every check passes, in order (for progress: step i of n)."""
    state, out, skipped = table[(START, "begin")], [], spec.skipped_steps()
    while state not in ENDS:
        if state in skipped:
            state = table[(state, "skip")]
            continue
        out.append(state)
        state = table.get((state, "done")) or table[(state, "passed")]
    return out


def run(ctx: JobContext, job_type: str,
        steps: dict[str, Callable[[JobContext], dict[str, Any]]]) -> JobRecord:
    """Drive the job to a terminal state (or raise Suspended); returns the final record."""
    store, jid, table = ctx.store, ctx.job_id, TRANSITIONS[job_type]
    for s in store.steps(jid):
        if s.status in ("done", "skipped"):
            ctx.outputs[s.name] = s.outputs or {}
    try:
        while (name := next_state(table, ctx.spec, ctx.outputs)) not in ENDS:
            if store.cancel_requested(jid) and name not in NOT_CANCELABLE:
                raise Canceled(f"canceled before {name}")
            if ctx.deadline is not None and time.time() > ctx.deadline:
                raise TimedOut(f"timeout_s passed before {name}")
            store.step_started(jid, name)
            ctx.current = name
            ctx.event(name, status="started")
            try:
                # Every step's whole process tree (this process, its probes, its child),
                # so the job's reported peak is the job's, not only the fine-tune's.
                with TreePeak() as peak:
                    out = steps[name](ctx)
                out = {**out, "tree_peak_mb": round(peak.peak_mb, 1)}
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
    if name == ROLLED_BACK:
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


def _err(code: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"code": code, "message": message, "retryable": retryable}
