"""finetune: the upstream trained on the device's data inside the memory budget, paced by the
thermal/power governor, resumed from its last checkpoint after any interruption.

Worker half: the set-up is resolved once, here where torch has nothing to decide
(``agent.finetune.setup.setup_without_torch``: an installed slot on a host without a GPU),
else by a ``setup`` child (``agent.finetune.recipe.resolve_setup``, which asks torch about
CUDA); the micro-batch is planned here, torch-free, against
the whole process tree's budget (this process, the probes, the child), and the result handed
to the ``finetune`` child, which trains on exactly that set-up. With the micro-batch given
there is nothing to plan: the fine-tune child resolves the set-up itself (one torch start
less). First of all, the data the job learns from is fixed (``agent.spool.lineage``): a spool
is snapshot into the job's folder.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.finetune.data_source import data_source
from agent.finetune.job import FinetuneJob, FinetuneSetup, too_few_samples
from agent.finetune.memory_fits import fit_key, record_fit
from agent.finetune.memory_plan import BudgetTooSmall, MemoryPlan, plan_micro_batch
from agent.finetune.setup import setup_without_torch
from agent.jobs.proctree import rss_mb
from agent.jobs.protocol import (
    SETUP,
    Canceled,
    JobContext,
    StepContext,
    StepFailed,
    child_main,
    run_child,
    step_context,
)
from agent.jobs.steps import export, pull
from agent.spool.lineage import fix_training_data, training_data_path
from registry.atomic import write_json_atomic


def _read_setup(job_dir: Path) -> FinetuneSetup | None:
    path = job_dir / SETUP
    return FinetuneSetup.model_validate_json(path.read_bytes()) if path.is_file() else None


def _plan(ctx: JobContext, setup: FinetuneSetup) -> MemoryPlan:
    """Probe (or reuse the cached probes of) this job's training step and fit the largest
    micro-batch whose whole-tree peak stays within the budget."""
    ft = ctx.spec.finetune
    probe_cfg = setup.train_config()
    probe_cfg = probe_cfg.model_copy(update={
        "run": probe_cfg.run.model_copy(update={"output_dir": ctx.job_dir / "probes"}),
        "training": probe_cfg.training.model_copy(update={"micro_batch_size": None})})
    start = Path(ctx.outputs["pull"]["path"])
    key = fit_key(ctx.spec.model, start, Path(ctx.spec.data), ft.model_dump())
    try:
        plan = plan_micro_batch(
            probe_cfg, start, ft.trainable, setup.budget_mb, device=setup.device,
            job_process_mb=rss_mb(os.getpid()),
            cache=ctx.state_dir / "cache" / "memory_probes.json")
    except BudgetTooSmall as e:  # the job's answer, not a crash to retry
        record_fit(ctx.state_dir, key, e.line)
        if ft.micro_batch is None:
            raise StepFailed("finetune", str(e)) from None
        # A forced micro-batch cannot fit a budget that holds no sample: the arguments are
        # what is wrong, as when the budget holds some samples but fewer than forced.
        raise StepFailed("finetune", f"finetune.micro_batch={ft.micro_batch} does not fit "
                         f"{e}", code="BAD_ARGS") from None
    except RuntimeError as e:  # a probe that cannot train at all: the job cannot either
        raise StepFailed("finetune", _probe_failure(str(e))) from None
    # Kept for the next submission of this job: a forced micro-batch is checked there.
    record_fit(ctx.state_dir, key, plan.line())
    return plan


BATCHNORM_ONE_SAMPLE = "Expected more than 1 value per channel when training"
"""torch's error when a BatchNorm layer trains on one value per channel: a micro-batch of one
reaching a 1x1 feature map (SSDlite's last extra layer)."""


def _probe_failure(error: str) -> str:
    """Why the plan failed, from a probe's error (its first line and its last)."""
    lines = [ln for ln in error.splitlines() if ln.strip()]
    why = f"{lines[0]} {lines[-1]}" if len(lines) > 1 else error
    if BATCHNORM_ONE_SAMPLE in error:
        why += (" (BatchNorm cannot train on one sample: set finetune.effective_batch to 8 or "
                "more, so that every probe's micro-batch holds at least 2)")
    return why


def _training_data(ctx: JobContext) -> dict[str, Any]:
    """Fix what the job learns from before anything trains (a spool: its snapshot), and
    refuse a spool too small for one optimizer step after the held-out split."""
    ft = ctx.spec.finetune
    try:
        data = fix_training_data(Path(ctx.spec.data), ctx.job_dir)
    except (OSError, ValueError) as e:
        raise StepFailed("finetune", f"data {ctx.spec.data}: {e}") from None
    why = too_few_samples(data.samples, f"data: the spool {ctx.spec.data}", ft.effective_batch,
                          ft.val_fraction) if data.source == "spool" else None
    if why is not None:
        raise StepFailed("finetune", why, code="BAD_ARGS")
    ctx.event("finetune", status="data", source=data.source, samples=data.samples,
              pseudo_labelled=data.pseudo_labelled, sha256=data.sha256)
    return data.model_dump(mode="json")


def _setup(ctx: JobContext) -> FinetuneSetup:
    """The set-up, here where no GPU can change it (no torch start, no child), else from the
    ``setup`` child. A job this side cannot read goes to the child, whose error the job
    reports as it always did."""
    from registry.errors import RegistryError

    context = step_context(ctx)
    try:
        setup = setup_without_torch(finetune_job(context))
    except (ValueError, RegistryError, OSError):  # pydantic's errors are ValueErrors too
        setup = None
    return setup or FinetuneSetup.model_validate(run_child(ctx, __name__, "setup", context))


def run(ctx: JobContext) -> dict[str, Any]:
    ft = ctx.spec.finetune
    why = export.refusal(ctx)  # before any training: the job could never finish
    if why is not None:
        raise StepFailed("finetune", why, code="BAD_ARGS")
    data = _training_data(ctx)
    try:  # the device data's layout must be one the model's task trains on
        data_source(training_data_path(Path(ctx.spec.data), ctx.job_dir),
                    pull.pulled_model(ctx).task)
    except ValueError as e:
        raise StepFailed("finetune", str(e), code="BAD_ARGS") from None
    setup = _read_setup(ctx.job_dir)
    # A micro-batch given beside an explicit budget is checked against it (probes), so a
    # job never trains past the budget it was given.
    check_forced = ft.micro_batch is not None and ft.budget_mb is not None
    if setup is None and (ft.micro_batch is None or check_forced):
        setup = _setup(ctx)
        write_json_atomic(ctx.job_dir / SETUP, setup.model_dump(mode="json"))
    if setup is not None and check_forced:  # re-checked on a resume: the probes are cached
        ctx.event("finetune", status="planning", budget_mb=setup.budget_mb)
        why = _plan(ctx, setup).refusal(ft.micro_batch)
        if why is not None:
            raise StepFailed("finetune", why, code="BAD_ARGS")
    if setup is not None and not setup.planned:
        ctx.event("finetune", status="planning", budget_mb=setup.budget_mb)
        setup = setup.with_plan(_plan(ctx, setup).to_dict())
        write_json_atomic(ctx.job_dir / SETUP, setup.model_dump(mode="json"))
    ctx.event("finetune", status="training", plan=setup.plan if setup else None)
    out = run_child(ctx, __name__, "finetune", step_context(ctx))
    if str(out.get("stopped_reason", "")).endswith("cancel"):
        raise Canceled("canceled during finetune")
    setup = _read_setup(ctx.job_dir)  # the child wrote it when it resolved it itself
    assert setup is not None
    out["memory"] = {"budget_mb": setup.budget_mb, "plan": setup.plan}
    out["data"] = data
    return out


# -- the child's half -------------------------------------------------------------------------


def finetune_job(c: StepContext) -> FinetuneJob:
    ft = c.spec["finetune"]
    # The application serving this model on this device is what training yields to.
    app = ({"state_dir": str(c.state_dir), "model": c.spec["model"],
            "slo_ms": c.spec.get("latency_slo_ms")} if ft.get("yield_to_app", True) else None)
    return FinetuneJob.model_validate({
        **ft, "checkpoint": str(c.upstream_path),
        "data": str(training_data_path(Path(c.spec["data"]), c.job_dir)),
        "out": str(c.job_dir / "finetune"), "app_latency": app})


def child_setup(c: StepContext) -> dict[str, Any]:
    """The fine-tune's set-up, unplanned (the worker plans it): needs torch (device, model)."""
    from agent.finetune.recipe import resolve_setup

    return resolve_setup(finetune_job(c), plan=False).model_dump(mode="json")


class StoreHook:
    """Cancel inside the fine-tune at the next optimizer step; progress a few times a second."""

    def __init__(self, state_dir: Path, job_id: str, interval_s: float = 0.5) -> None:
        from agent.jobs.store import JobStore

        self.store, self.job_id, self.interval_s = JobStore(state_dir), job_id, interval_s
        self._last = 0.0

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s and step < trainer.total_steps:
            return
        self._last = now
        # One indexed read; the throttle keeps it off the hot path of tiny steps.
        if self.store.cancel_requested(self.job_id):
            trainer.request_stop("cancel")
        self.store.set_progress(self.job_id, {
            "id": self.job_id, "stage": "finetune", "step": step, "total": trainer.total_steps,
            "pct": round(100 * step / max(trainer.total_steps, 1), 1),
            "detail": {"loss": metrics.get("train/loss"),
                       "micro_batch": trainer.state.micro_batch_size, **_governor(trainer)},
        })


def _governor(trainer: Any) -> dict[str, Any]:
    """The governor's last decision, when one paces this run (its hook keeps ``last``)."""
    for h in getattr(trainer, "hooks", []):
        d = getattr(h, "last", None)
        if d is not None and hasattr(d, "duty"):
            state = getattr(d.state, "value", d.state)
            return {"governor": str(state), "duty": round(float(d.duty), 2),
                    "temp_c": d.temp_c, "limit": d.limit}
    return {}


def child(c: StepContext) -> dict[str, Any]:
    """Train on the job's set-up (resolved here when the worker had nothing to plan), paced by
    the governor, resumed from the last checkpoint; report.json/.png go to JOB_DIR/finetune."""
    from agent.finetune.recipe import resolve_setup, run_paced

    job = finetune_job(c)
    if c.setup is not None:
        setup = FinetuneSetup.model_validate(c.setup)
    else:
        setup = resolve_setup(job, plan=False)
        write_json_atomic(c.job_dir / SETUP, setup.model_dump(mode="json"))
    hook = StoreHook(c.state_dir, c.job_id)
    try:
        result = run_paced(job, resume=True, hooks=[hook], setup=setup, state_dir=c.state_dir)
    finally:
        hook.store.close()
    r = result.report
    gov = r.get("governor") or {}
    png = job.out / "report.png"  # written only when a governor paced the run
    return {
        "checkpoint": r["checkpoint"], "stopped_reason": r["stopped_reason"], "steps": r["steps"],
        "accuracy_before": r["accuracy_before"], "accuracy_after": r["accuracy_after"],
        "gate_metric": r["gate_metric"], "metric_before": r["metric_before"],
        "metric_after": r["metric_after"],
        "micro_batch_size": r["micro_batch_size"],
        "train_samples": r["train_samples"], "held_out_samples": r["held_out_samples"],
        "trainable_params": r["trainable_params"], "total_params": r["total_params"],
        "accumulation_steps": -(-job.effective_batch // r["micro_batch_size"]),
        "peak_rss_mb": r["peak_rss_mb"],
        "precision": r["precision"], "max_temp_c": gov.get("max_temp_c"),
        "target_c": result.target_c, "governor": gov or None,
        "report_png": str(png) if png.is_file() else None,
    }


CHILDREN: dict[str, Callable[[StepContext], dict[str, Any]]] = {
    "setup": child_setup, "finetune": child}
"""This step's torch halves by name: ``python -m agent.jobs.steps.finetune NAME JOB_DIR``
(:func:`agent.jobs.protocol.child_main`)."""

if __name__ == "__main__":
    sys.exit(child_main(CHILDREN))
