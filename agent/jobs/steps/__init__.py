"""The device job's steps, one module each holding both halves: the worker's function
(torch-free, in the job process) and, for the heavy steps, the child's
(``python -m agent.jobs.child STEP JOB_DIR``), so a reader sees a step whole. Which step
follows which is the state machine's table (``agent.jobs.machine``), not theirs.

To add a step: a module here with ``run(ctx: JobContext) -> dict`` (and ``child(c:
StepContext) -> dict`` if it needs torch), one entry in :data:`WORKER_STEPS` (and
:data:`CHILD_STEPS`), and its edges in the machine's table for the job types that run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.jobs.protocol import JobContext, StepContext
from agent.jobs.steps import (
    commit,
    evaluate,
    export,
    finetune,
    health,
    pull,
    stage,
    switch,
    upload,
)

WORKER_STEPS: dict[str, Callable[[JobContext], dict[str, Any]]] = {
    "pull": pull.run, "finetune": finetune.run, "export": export.run, "stage": stage.run,
    "health": health.run, "commit": commit.run, "rollback": commit.rollback,
    "upload": upload.run, "switch": switch.run, "evaluate": evaluate.run,
}
"""State name -> the function the worker runs for it."""

CHILD_STEPS: dict[str, Callable[[StepContext], dict[str, Any]]] = {
    "fetch": pull.child_fetch, "setup": finetune.child_setup, "finetune": finetune.child,
    "export_prepare": export.child_prepare, "export": export.child, "stage": stage.child,
    "health": health.child, "evaluate": evaluate.child,
}
"""Child step name -> the function ``python -m agent.jobs.child`` runs (torch side)."""
