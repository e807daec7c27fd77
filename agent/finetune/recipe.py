"""One on-device fine-tune job: the upstream model, the device's data, the board's limits.

It is ``hpc_core.Trainer`` with a different config — never a second loop:
- the memory budget (job or profile) becomes a micro-batch picked by probing
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
from typing import Any

import torch

from agent.finetune.cold_pages import drop_cold_pages
from agent.finetune.job import FinetuneJob, FinetuneResult
from agent.finetune.memory_plan import plan_micro_batch
from agent.finetune.model import enable_activation_checkpointing, prepare_model
from hpc_core import checkpoint as ckpt
from hpc_core.atomic import write_json_atomic
from hpc_core.config import ModelConfig, TrainConfig, config_from_dict
from hpc_core.metrics import peak_device_mb, peak_rss_mb
from hpc_core.trainer import Trainer, TrainerHook

log = logging.getLogger(__name__)


def resolve_profile(name: str) -> Any:
    from device_profiles import detect_profile, load_profile

    return detect_profile() if name == "auto" else load_profile(name)


def pick_precision(job: FinetuneJob, profile: Any, device: str) -> str:
    if job.precision != "auto":
        return job.precision
    if device != "cuda":
        return "fp32"
    return "bf16" if profile.precision.bf16 else ("fp16" if profile.precision.fp16 else "fp32")


def build_config(
    job: FinetuneJob, upstream: ModelConfig, precision: str, micro: int | None
) -> TrainConfig:
    source = "image_folder" if job.data.is_dir() else "npz"
    return config_from_dict(
        {
            "run": {
                "name": f"finetune-{job.out.name}",
                "output_dir": str(job.out),
                "seed": job.seed,
            },
            "data": {
                "source": source,
                "path": str(job.data),
                "image_size": upstream.image_size,
                "grayscale": upstream.in_channels == 1,
                "val_fraction": job.val_fraction,
                "split_seed": job.seed,
            },
            "model": upstream.model_dump(mode="json"),
            "optimizer": {"name": job.optimizer, "lr": job.lr, "weight_decay": 0.0},
            "schedule": {"warmup_steps": 0, "decay": "cosine"},
            "training": {
                "global_batch_size": job.effective_batch,
                "micro_batch_size": micro,
                "max_steps": job.steps,
                "epochs": job.epochs,
                "precision": precision,
                "device": job.device,
                "grad_clip_norm": 1.0,
            },
            "checkpoint": {
                "every_steps": job.checkpoint_every,
                "keep_last": 2,
                "best_metric": None,
            },
            "faults": {"max_nan_rollbacks": 3},
            "logging": {"log_every_steps": 5, "progress": "auto"},
        },
        source="fine-tune job",
    )


def run_finetune(
    job: FinetuneJob, hooks: list[TrainerHook] | None = None, resume: bool = False
) -> FinetuneResult:
    profile = resolve_profile(job.profile)
    device = "cuda" if job.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    installed_slot = (job.checkpoint / "manifest.json").is_file()
    init = job.checkpoint if installed_slot else ckpt.resolve_checkpoint(job.checkpoint)
    model, upstream = prepare_model(init, job.trainable)
    drop_cold_pages()  # torch's start-up code: see agent.finetune.cold_pages
    precision = pick_precision(job, profile, device)
    budget = (
        job.budget_mb if job.budget_mb is not None else float(profile.memory.training_budget_mb)
    )
    job.out.mkdir(parents=True, exist_ok=True)

    plan = None
    micro = job.micro_batch
    if micro is None:
        # The budget here is the training process's own (standalone ``python -m
        # agent.finetune``); the device job budgets its whole process tree and plans in its
        # torch-free worker (agent.jobs.steps.finetune).
        plan = plan_micro_batch(
            build_config(job, upstream, precision, None), init, job.trainable, budget,
            device=device,
        )
        micro = plan.micro_batch_size
    cfg = build_config(job, upstream, precision, micro)
    if job.activation_checkpointing:
        enable_activation_checkpointing(model)
    trainer = Trainer(cfg, model=model, hooks=hooks or [])
    drop_cold_pages()  # and the optimizer's (torch._dynamo); the probes drop at the same points
    before = trainer.evaluate() if not (resume and ckpt.find_latest(trainer.ckpt_root)) else None
    result = trainer.train(resume="auto" if resume else None)
    report = {
        "job": json.loads(job.model_dump_json()),
        "profile": profile.name,
        "device": device,
        "precision": precision,
        "trainable_params": sum(p.numel() for p in trainer.params),
        "memory_plan": plan.to_dict() if plan else None,
        "micro_batch_size": trainer.state.micro_batch_size,
        "budget_mb": budget,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_device_mb": peak_device_mb(trainer.device),
        "accuracy_before": before["eval/acc"] if before else None,
        "accuracy_after": result.metrics.get("eval/acc"),
        "steps": result.final_step,
        "stopped_reason": result.stopped_reason,
        "checkpoint": str(result.checkpoint_dir) if result.checkpoint_dir else None,
    }
    write_json_atomic(job.out / "report.json", report)
    return FinetuneResult(report, result.checkpoint_dir)


@dataclass
class PacedResult:
    report: dict[str, Any]
    """The fine-tune's figures, with the governor's summary under "governor" when paced."""
    target_c: float
    """The profile's thermal target, for the summary line."""


def run_paced(
    job: FinetuneJob, resume: bool = False, hooks: list[TrainerHook] | None = None
) -> PacedResult:
    """The whole device recipe: the job paced by the governor reading ``job.sensors``, then one
    report per job (OUT/report.json + report.png): the fine-tune's figures under "job", pacing
    over time beside them. ``hooks`` run before the governor's (the device job's progress
    and cancel hook)."""
    from agent.pacing.governor import Governor, GovernorConfig
    from agent.pacing.hook import GovernorHook
    from agent.pacing.report import Limits, build_report, write_report
    from agent.sensors import open_backend

    profile = resolve_profile(job.profile)
    hook = None
    sensors_cm = (
        contextlib.nullcontext()
        if job.sensors == "none"
        else open_backend(job.sensors, profile=profile, sim_time_scale=job.sim_time_scale)
    )
    with sensors_cm as sensors:
        if sensors is not None:
            hook = GovernorHook(
                Governor(GovernorConfig.from_profile(profile), profile=profile), sensors
            )
        result = run_finetune(job, hooks=[*(hooks or []), *([hook] if hook else [])],
                              resume=resume)
    report = result.report
    t = profile.thermal
    if hook is not None:
        limits = Limits(
            target_c=t.throttle_target_c,
            soft_pause_c=t.soft_pause_c,
            board_throttle_c=t.board_throttle_c,
            critical_c=t.critical_c,
        )
        keys = ("accuracy_before", "accuracy_after", "peak_rss_mb", "budget_mb",
                "micro_batch_size")
        summary = {k: report[k] for k in keys}
        governed = build_report(hook, limits, job=report, extra_summary=summary)
        write_report(governed, job.out, stem="report")
        report["governor"] = governed.summary
    return PacedResult(report, t.throttle_target_c)
