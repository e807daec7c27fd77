"""One on-device fine-tune job: the upstream model, the device's data, the board's limits.

It is ``hpc_core.Trainer`` with a different config — never a second loop:
- the set-up (profile, device, precision, budget, TrainConfig) is resolved once, here
  (:func:`resolve_setup`, into ``agent.finetune.job.FinetuneSetup``); the memory budget
  becomes a micro-batch picked by probing
  (``agent.finetune.memory_plan``) and gradient accumulation up to the effective batch; the
  trainer's OOM halving stays as the safety net;
- the trainable scope (``head | last_n:K | all``) freezes the rest (no gradients, no saved
  activations; frozen BatchNorm stays in eval mode inside the trainer);
- precision follows the profile (bf16 on Orin, fp16 on Xavier/Nano, fp32 on CPU);
- pacing (the thermal/power governor) comes in as a trainer hook.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.finetune.cold_pages import drop_cold_pages
from agent.finetune.job import FinetuneJob, FinetuneResult, FinetuneSetup, resolve_profile
from agent.finetune.memory_plan import plan_micro_batch
from agent.finetune.model import enable_activation_checkpointing, load_upstream, prepare_model
from agent.finetune.setup import setup_on
from device_profiles.schema import DeviceProfile
from hpc_core import checkpoint as ckpt
from hpc_core.metrics import peak_device_mb, peak_rss_mb
from hpc_core.trainer import Trainer, TrainerHook
from registry.atomic import write_json_atomic
from registry.model_config import ModelConfig

log = logging.getLogger(__name__)


def resolve_setup(job: FinetuneJob, upstream: ModelConfig | None = None, *,
                  plan: bool = True) -> FinetuneSetup:
    """Decide the fine-tune's set-up from the job and the board. ``upstream``: the model's
    spec when the caller has loaded it (read from the checkpoint otherwise). ``plan``: probe
    for the micro-batch here, against this process's own budget (the standalone fine-tune);
    the device job passes False and plans in its worker against the whole process tree."""
    if job.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("finetune.device=cuda but no CUDA device is visible here: use auto "
                         "(CUDA where there is one) or cpu")
    device = "cuda" if job.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    slot = (job.checkpoint / "manifest.json").is_file()
    init = job.checkpoint if slot else ckpt.resolve_checkpoint(job.checkpoint)
    if upstream is None:
        _, upstream = load_upstream(init)
    setup = setup_on(job, upstream, init, device)
    if plan and not setup.planned:
        found = plan_micro_batch(setup.train_config(), init, job.trainable, setup.budget_mb,
                                 device=device)
        setup = setup.with_plan(found.to_dict())
    return setup


def run_finetune(
    job: FinetuneJob, hooks: list[TrainerHook] | None = None, resume: bool = False,
    setup: FinetuneSetup | None = None,
) -> FinetuneResult:
    """Train ``job`` on its resolved ``setup`` (the device job hands its own over; alone, the
    set-up is resolved here and the micro-batch planned against this process's budget)."""
    if setup is None:
        model, upstream = prepare_model(
            job.checkpoint if (job.checkpoint / "manifest.json").is_file()
            else ckpt.resolve_checkpoint(job.checkpoint), job.trainable)
        drop_cold_pages()  # torch's start-up code: see agent.finetune.cold_pages
        setup = resolve_setup(job, upstream, plan=True)
    else:
        model, _ = prepare_model(setup.checkpoint, job.trainable)
        drop_cold_pages()
    cfg = setup.train_config()
    job.out.mkdir(parents=True, exist_ok=True)
    if job.activation_checkpointing:
        enable_activation_checkpointing(model)
    trainer = Trainer(cfg, model=model, hooks=hooks or [])
    drop_cold_pages()  # and the optimizer's (torch._dynamo); the probes drop at the same points
    before = trainer.evaluate() if not (resume and ckpt.find_latest(trainer.ckpt_root)) else None
    gate = f"eval/{trainer.task.gate_metric}"
    result = trainer.train(resume="auto" if resume else None)
    report = {
        "job": json.loads(job.model_dump_json()),
        "profile": setup.profile,
        "device": setup.device,
        "precision": setup.precision,
        "trainable_params": sum(p.numel() for p in trainer.params),
        "total_params": sum(p.numel() for p in trainer.raw_model.parameters()),
        "train_samples": len(trainer.train_ds),  # type: ignore[arg-type]
        "held_out_samples": len(trainer.val_ds),  # type: ignore[arg-type]
        "memory_plan": setup.plan,
        "micro_batch_size": trainer.state.micro_batch_size,
        "budget_mb": setup.budget_mb,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_device_mb": peak_device_mb(trainer.device),
        "accuracy_before": before.get("eval/acc") if before else None,
        "accuracy_after": result.metrics.get("eval/acc"),
        # The task's gate metric (eval/acc of a classifier, eval/map of a detector).
        "gate_metric": gate,
        "metric_before": before.get(gate) if before else None,
        "metric_after": result.metrics.get(gate),
        "steps": result.final_step,
        "stopped_reason": result.stopped_reason,
        "checkpoint": str(result.checkpoint_dir) if result.checkpoint_dir else None,
    }
    write_json_atomic(job.out / "report.json", report)
    return FinetuneResult(report, result.checkpoint_dir)


def _mode_switcher(job: FinetuneJob, profile: DeviceProfile) -> tuple[Any, str | None]:
    """The board's power-mode switcher when the job allows switching, or why there is none."""
    if not job.switch_power_modes:
        return None, None
    from device_profiles.nvpmodel import NvpmodelError, NvpmodelSwitcher, mode_setter

    setter, how = mode_setter()
    if setter is None:
        return None, f"power-mode switching unavailable: {how}"
    try:
        return NvpmodelSwitcher(profile, setter=setter), None
    except (NvpmodelError, OSError) as e:
        return None, f"power-mode switching unavailable: {e}"


@dataclass
class PacedResult:
    report: dict[str, Any]
    """The fine-tune's figures, with the governor's summary under "governor" when paced."""
    target_c: float
    """The profile's thermal target, for the summary line."""


def run_paced(
    job: FinetuneJob, resume: bool = False, hooks: list[TrainerHook] | None = None,
    setup: FinetuneSetup | None = None, state_dir: Path | None = None,
) -> PacedResult:
    """The whole device recipe: the job paced by the governor reading ``job.sensors``, then one
    report per job (OUT/report.json + report.png): the fine-tune's figures under "job", pacing
    over time beside them. ``hooks`` run before the governor's (the device job's progress
    and cancel hook). ``state_dir``: the device's, whose one simulated board ``sensors: sim``
    heats and reads, as its daemon does (``agent.sensors.sim.SimBoard``)."""
    from agent.pacing.app_latency import RuntimeLatency
    from agent.pacing.governor import Governor, GovernorConfig
    from agent.pacing.hook import GovernorHook, ThreadYield
    from agent.pacing.report import Limits, build_report, write_report
    from agent.sensors import open_backend

    profile = resolve_profile(setup.profile if setup is not None else job.profile)
    hook = None
    sensors_cm = (
        contextlib.nullcontext()
        if job.sensors == "none"
        else open_backend(job.sensors, profile=profile, sim_time_scale=job.sim_time_scale,
                          state_dir=state_dir)
    )
    with sensors_cm as sensors:
        if sensors is not None:
            latency = (RuntimeLatency(job.app_latency)
                       if job.app_latency is not None and job.yield_to_app else None)
            switcher, why_not = _mode_switcher(job, profile)
            governor = Governor(
                GovernorConfig.from_profile(profile, allow_mode_switch=switcher is not None),
                profile=profile, switcher=switcher)
            if why_not:
                governor.note_unavailable("power_mode", why_not)
            # Cores first, then time: a step that shares none of the application's cores
            # costs its requests nothing (agent.pacing.hook.ThreadYield).
            threads = (ThreadYield(torch.set_num_threads, torch.get_num_threads())
                       if latency is not None else None)
            hook = GovernorHook(governor, sensors, latency=latency, power_mode=switcher,
                                threads=threads)
        result = run_finetune(job, hooks=[*(hooks or []), *([hook] if hook else [])],
                              resume=resume, setup=setup)
    report = result.report
    t = profile.thermal
    if hook is not None:
        limits = Limits(
            target_c=t.throttle_target_c,
            soft_pause_c=t.soft_pause_c,
            board_throttle_c=t.board_throttle_c,
            critical_c=t.critical_c,
        )
        keys = ("accuracy_before", "accuracy_after", "gate_metric", "metric_before",
                "metric_after", "peak_rss_mb", "budget_mb", "micro_batch_size")
        summary = {k: report[k] for k in keys}
        governed = build_report(hook, limits, job=report, extra_summary=summary)
        write_report(governed, job.out, stem="report")
        report["governor"] = governed.summary
    return PacedResult(report, t.throttle_target_c)
