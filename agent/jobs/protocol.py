"""How a device job's processes work together; torch-free (the daemon imports it).

    daemon --python -P -m agent.jobs.worker--> worker (the state machine, ~35 MB)
    worker --python -P -m agent.jobs.steps.STEP CHILD JOB_DIR--> one torch child per heavy step

Everything that crosses a process boundary is here: how a process is started
(:func:`python_argv`) and tied to its parent (``registry.lifetime``), the exit codes, the
typed :class:`StepContext` a child reads instead of free-form JSON (and :func:`step_context`,
which builds it from the job so far), both sides of a child step (:func:`run_child` in the
worker: heartbeat, SIGTERM forwarding, deadline, its output; :func:`child_main` in the child),
the exceptions a step ends with, the :class:`StopFlag` a SIGTERM handler sets, and the fault
injection the restart tests use. Steps (``agent.jobs.steps``) and the state machine
(``agent.jobs.machine``) import this module; it imports neither.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from agent.jobs.store import JobStore
from agent.storage.trust import default_trusted_keys, load_trusted
from registry.atomic import write_json_atomic
from registry.lifetime import die_with_parent, skip_startup_and_exit_collections

EX_TEMPFAIL = 75
"""Suspended by SIGTERM (sysexits' EX_TEMPFAIL: try again later): the job checkpointed (or had
not started) and stays in the job store, unfinished; it resumes on the next start. The worker
exits with it, the daemon's runner tells a suspended job from a crashed one by it, and
``agentctl finetune`` passes it on."""

EX_BUSY = 5
"""Another job holds the state dir's job lock (``agent.storage.lock.JobLock``): this one was
not touched and runs once that one ends. ``agentctl`` reports the same exit code for a busy
state lock (``registry.errors.StateBusyError``)."""

CONTEXT = "context.json"
"""JOB_DIR/context.json: the :class:`StepContext` of the child step about to run."""

SETUP = "setup.json"
"""JOB_DIR/setup.json: the fine-tune's resolved set-up (``agent.finetune.job``), written
once, read by the fine-tune and the steps after it."""

HEARTBEAT_S = 5.0
"""A running child step is reported this often, with the last line of its log."""

CRASH_ENV = "EDGETRAIN_JOB_CRASH_AT"
"""Fault injection for the restart tests and drills: ``after:STEP`` SIGKILLs the job process
right after STEP is recorded done; ``inside:STEP`` while STEP's child runs (the short stage
step's child kills the job itself: :func:`crash_inside_child`)."""


# -- starting processes -------------------------------------------------------------------------


def python_argv(module: str, *args: str) -> list[str]:
    """``python -P -m MODULE ARGS``: the worker and each child run a module of this package by
    name, so the directory they start in must never provide that module. ``-P`` (3.11+) keeps
    the working directory off ``sys.path``; on 3.10 (no flag) the working directory is the
    guard: the daemon starts the worker in its 0700 state dir, the children inherit it."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, "-m", module, *args]


class StopFlag:
    """Set by the job process's SIGTERM handler, read by the child wait loop (which forwards
    the signal and suspends the job). Passed in, never a module global: a test or a second
    job in one process has its own."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:  # async-signal-safe: one attribute store
        self._set = True

    def __bool__(self) -> bool:
        return self._set


# -- how a step ends -------------------------------------------------------------------------


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


def crash_point(point: str) -> None:
    if point in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def crash_inside_child(step: str) -> None:
    """Fault injection (``inside:STEP``) for a step too short for the worker's wait loop to
    catch under way: kill -9 of the job process from the child, then of the child, at a known
    point of the step's work."""
    if f"inside:{step}" in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


# -- the worker's side --------------------------------------------------------------------------


def job_dir_of(state_dir: Path, job_id: str) -> Path:
    return Path(state_dir) / "jobs" / job_id


@dataclass
class JobContext:
    """What every step function gets in the worker: the store, the job's resolved spec, the
    outputs of the steps done so far."""

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
    stop: StopFlag = field(default_factory=StopFlag)
    """Set on SIGTERM: the running child is told, the job suspends."""
    planned: list[str] = field(default_factory=list)
    """The steps the job runs when every check passes (``agent.jobs.machine.planned_steps``):
    progress says "step i of n"."""

    @property
    def job_dir(self) -> Path:
        return job_dir_of(self.state_dir, self.job_id)

    def model_name(self) -> str:
        """The job's model; a rollback job without one means "the only installed model"."""
        name = getattr(self.spec, "model", None) or getattr(self.spec, "name", None)
        if name is None:
            models = sorted(p.name for p in (self.state_dir / "models").glob("*")
                            if p.is_dir())
            if len(models) != 1:
                raise StepFailed("switch", f"name is needed: installed models are {models}",
                                 code="BAD_ARGS")
            name = models[0]
        return str(name)

    def event(self, stage: str, *, publish: bool = True, **detail: Any) -> None:
        """Feed the display and (``publish``) the job's progress row, which the daemon
        announces: it names the step now running, so telemetry never shows the last
        fine-tune step while the export runs. The fine-tune child writes its own richer
        progress (optimizer step, loss, governor), so its heartbeats pass publish=False."""
        if publish:
            names = self.planned
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


class StepContext(BaseModel):
    """What a child step gets from the worker (JOB_DIR/context.json), typed: the job's spec
    and what earlier steps produced. Written before each child starts, read by it once."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    state_dir: Path
    job_dir: Path
    spec: dict[str, Any]
    """The job's resolved spec (DeviceJob / DeployJob) as JSON; each step validates its part."""
    upstream_path: Path | None = None
    """The version the job started from (pull's output: a slot or the job's copy)."""
    finetuned: Path | None = None
    """The fine-tune's final checkpoint."""
    artefacts: list[Path] = []
    """The files the export step installed (staged and signed with the weights)."""
    setup: dict[str, Any] | None = None
    """The fine-tune's setup (``agent.finetune.job.FinetuneSetup``), resolved once per job:
    profile, device, precision, budget, TrainConfig and memory plan."""
    signing_key: Path
    trusted_keys: Path
    active_path: Path | None = None
    """The health check's reference: the active slot (or, on a device with none, the
    upstream)."""
    staged_path: Path | None = None
    own_path: Path | None = None
    """The device's own model (its active slot) where a step reads parts of it: the evaluate
    step's personalized score, the personalize step."""
    personalized: Path | None = None
    """The personalize step's weights (a folder holding model.safetensors) that stage signs."""

    @property
    def micro_batch(self) -> int | None:
        """The micro-batch the fine-tune's set-up fixed (the plan's, or the job's own): the
        largest batch known to fit the job's budget. None before the set-up exists."""
        micro = ((self.setup or {}).get("config") or {}).get("training", {}).get(
            "micro_batch_size")
        return int(micro) if micro else None


def trusted_dir(ctx: JobContext) -> Path:
    """The job's trusted-keys folder: from its resolved spec, i.e. the device's configuration."""
    return Path(ctx.spec.trusted_keys or default_trusted_keys(ctx.state_dir))


def trusted_keys(ctx: JobContext) -> Any:
    """The job's trusted keys, checked on disk first (``agent.storage.trust``)."""
    return load_trusted(trusted_dir(ctx))


def signing_key_path(ctx: JobContext) -> Path:
    return Path(getattr(ctx.spec, "signing_key", None) or ctx.state_dir / "device.key.pem")


def export_artefacts(outputs: dict[str, Any]) -> list[str]:
    """The files the export step installed (a job exported before model.onnx.json existed
    recorded only ``artefact``)."""
    ex = outputs.get("export", {})
    return list(ex.get("artefacts") or ([ex["artefact"]] if ex.get("artefact") else []))


def step_context(ctx: JobContext, **extra: Any) -> StepContext:
    """The child's view of the job so far: spec, the upstream, the fine-tuned checkpoint, the
    export's files, the set-up, the keys."""
    o = ctx.outputs
    setup = read_output(ctx.job_dir / SETUP) or None
    return StepContext(
        job_id=ctx.job_id, state_dir=ctx.state_dir, job_dir=ctx.job_dir,
        spec=ctx.spec.model_dump(mode="json"),
        upstream_path=o.get("pull", {}).get("path"),
        finetuned=o.get("finetune", {}).get("checkpoint"),
        artefacts=[Path(a) for a in export_artefacts(o)],
        setup=setup, signing_key=signing_key_path(ctx), trusted_keys=trusted_dir(ctx),
        **extra,
    )


def write_context(ctx: StepContext) -> None:
    write_json_atomic(ctx.job_dir / CONTEXT, ctx.model_dump(mode="json"))


def read_context(job_dir: Path) -> StepContext:
    return StepContext.model_validate_json((job_dir / CONTEXT).read_bytes())


def read_output(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 400))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][-160:] if lines else ""


def _child_under_way(ctx: JobContext, step: str, elapsed: float) -> bool:
    """Fault injection: the child is well inside its work (the fine-tune past a checkpoint).
    The stage and a fetch take a fraction of a second (the spec check is torch-free): their
    children kill the job themselves."""
    if step in ("stage", "fetch"):
        return False
    if step == "finetune":
        prog = ctx.store.get(ctx.job_id).progress or {}  # type: ignore[union-attr]
        every = ctx.spec.finetune.checkpoint_every
        return prog.get("stage") == "finetune" and prog.get("step", 0) >= every + every // 2
    return elapsed >= 1.5


def run_child(ctx: JobContext, module: str, step: str, context: StepContext) -> dict[str, Any]:
    """Run ``python -m MODULE STEP JOB_DIR`` (the step module's child half ``STEP``, see
    :func:`child_main`) on ``context`` and return what it wrote (JOB_DIR/STEP.json):
    heartbeats while it runs, SIGTERM forwarded (the trainer checkpoints at its next step) and
    the job suspended, killed at the job's deadline."""
    write_context(context)
    out = ctx.job_dir / f"{step}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(ctx.job_dir / f"{step}.log", "ab")  # noqa: SIM115 - closed below
    try:
        p = subprocess.Popen(python_argv(module, step, str(ctx.job_dir.absolute())),
                             stdout=log, stderr=log, env=env)
        forwarded, t0, beat = False, time.monotonic(), time.monotonic()
        inside = f"inside:{ctx.current}" in os.environ.get(CRASH_ENV, "").split(",")
        while p.poll() is None:
            if inside and _child_under_way(ctx, step, time.monotonic() - t0):
                crash_point(f"inside:{ctx.current}")
            if time.monotonic() - beat >= HEARTBEAT_S:  # long exports: never minutes of silence
                beat = time.monotonic()
                ctx.event(step, publish=step != "finetune", status="running",
                          elapsed_s=round(beat - t0), last=_last_line(ctx.job_dir / f"{step}.log"))
            if ctx.stop and not forwarded:
                p.send_signal(signal.SIGTERM)
                forwarded = True
            if ctx.deadline is not None and time.time() > ctx.deadline:
                p.kill()
                p.wait()
                raise TimedOut(f"timeout_s passed during {step}")
            time.sleep(0.05)
    finally:
        log.close()
    if ctx.stop:
        raise Suspended(step)
    if p.returncode != 0:
        tail = (ctx.job_dir / f"{step}.log").read_text(errors="replace")[-1500:]
        raise StepFailed(step, f"exited with {p.returncode}: {tail.strip().splitlines()[-1:]}",
                         code="INTERNAL")
    return read_output(out)


# -- the child's side ---------------------------------------------------------------------------


def child_main(children: dict[str, Callable[[StepContext], dict[str, Any]]]) -> int:
    """``python -m agent.jobs.steps.MODULE CHILD JOB_DIR``: one torch half of a step.

    The worker stays torch-free (~35 MB) so that the memory budget can go to the one torch
    process alive at a time: the planner's probes, then the fine-tune, export or health check.
    The child reads its typed context (JOB_DIR/context.json), runs ``children[CHILD]`` (the
    step module's own table: argv names an entry, never a function) and writes
    JOB_DIR/CHILD.json atomically when it is done; the worker records that in the store."""
    skip_startup_and_exit_collections()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the step imports torch
    step, job_dir = sys.argv[1], Path(sys.argv[2])
    die_with_parent()
    out = children[step](read_context(job_dir))
    write_json_atomic(job_dir / f"{step}.json", out)
    return 0
