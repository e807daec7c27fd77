"""One on-device fine-tune job: the upstream model, the device's data, the board's limits.

It is ``hpc_core.Trainer`` with a different config — never a second loop:
- the memory budget (job or profile) becomes a micro-batch picked by probing
  (``agent.memory_plan``) and gradient accumulation up to the effective batch; the trainer's
  OOM halving stays as the safety net;
- the trainable scope (``head | last_n:K | all``) freezes the rest (no gradients, no saved
  activations; frozen BatchNorm stays in eval mode inside the trainer);
- precision follows the profile (bf16 on Orin, fp16 on Xavier/Nano, fp32 on CPU);
- pacing (the thermal/power governor) comes in as a trainer hook.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpc_core import checkpoint as ckpt
from hpc_core.atomic import write_json_atomic
from hpc_core.config import ModelConfig, TrainConfig, config_from_dict
from hpc_core.metrics import peak_device_mb, peak_rss_mb
from hpc_core.models import build_model
from hpc_core.trainer import Trainer, TrainerHook

log = logging.getLogger(__name__)

TRAINABLE_RE = re.compile(r"^(head|all|last_n:([1-9][0-9]*))$")


class FinetuneJob(BaseModel):
    """What `agentctl finetune` and the daemon's fine-tune command accept."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    checkpoint: Path
    """The upstream model: an hpc_core checkpoint or run directory, or an installed slot."""
    data: Path
    """The device's data: a folder of class sub-folders (PNG/JPEG) or an .npz with x and y."""
    out: Path
    """Job directory: metrics.jsonl, checkpoints/, report.json, report.png."""
    profile: str = "auto"
    """Device profile name, or auto (detect from /proc/device-tree/model)."""
    budget_mb: float | None = Field(default=None, gt=0)
    """Memory budget for training in MB (null = the profile's training budget)."""
    effective_batch: int = Field(default=64, ge=1)
    """Samples per optimizer step; micro-batches accumulate up to it."""
    micro_batch: int | None = Field(default=None, ge=1)
    """Force the micro-batch instead of probing (null = plan from the budget; set it to
    effective_batch for an unbounded run)."""
    steps: int | None = Field(default=None, ge=1)
    """Optimizer steps (wins over epochs)."""
    epochs: int | None = Field(default=None, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """sgd uses momentum 0.9."""
    trainable: str = "head"
    """head | last_n:K (the last K conv/linear layers and their norms) | all"""
    activation_checkpointing: bool = False
    """Recompute activations of trainable blocks in backward: less memory, ~30% more compute."""
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """auto = bf16 where the profile has it, else fp16, on CUDA; fp32 on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: int = Field(default=25, ge=1)
    """Save every N steps so a reboot resumes instead of restarting."""
    val_fraction: float = Field(default=0.3, gt=0, lt=1)
    """Share of the device data held out to measure accuracy before and after."""
    seed: int = 0

    @field_validator("trainable")
    @classmethod
    def _trainable(cls, v: str) -> str:
        if not TRAINABLE_RE.match(v):
            raise ValueError(f"trainable must be head, all or last_n:K (K >= 1), got {v!r}")
        return v

    @model_validator(mode="after")
    def _length(self) -> FinetuneJob:
        if self.steps is None and self.epochs is None:
            self.epochs = 3
        return self


@dataclass
class FinetuneResult:
    report: dict[str, Any]
    checkpoint_dir: Path | None


# ---------------------------------------------------------------------------------------------
# Model preparation


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def apply_trainable(model: nn.Module, scope: str) -> int:
    """Freeze all but ``scope``; return the number of trainable parameters."""
    if scope == "all":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        k = 1 if scope == "head" else int(scope.split(":")[1])
        layers = _layers(model)
        if k > len(layers):
            raise ValueError(
                f"trainable={scope}: the model has only {len(layers)} conv/linear layers"
            )
        for p in model.parameters():
            p.requires_grad_(False)
        first = layers[-k]
        # Everything registered after the first trainable layer (incl. its norms) trains.
        seen = False
        for m in model.modules():
            seen = seen or m is first
            if seen:
                for p in m.parameters(recurse=False):
                    p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute the trainable children of every Sequential in backward; return how many."""
    count = 0
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        for block in seq.children():
            trainable = any(p.requires_grad for p in block.parameters())
            if trainable and not isinstance(block, nn.Sequential) and list(block.parameters()):
                # An instance attribute keeps state_dict keys unchanged (no wrapper module).
                block.forward = functools.partial(  # type: ignore[method-assign]
                    checkpoint, type(block).forward.__get__(block), use_reentrant=False
                )
                count += 1
    return count


def load_upstream(path: Path) -> tuple[nn.Module, ModelConfig]:
    """An installed A/B slot (signed manifest + safetensors) or an hpc_core checkpoint/run."""
    if (path / "manifest.json").is_file():
        from safetensors.torch import load_file

        from hpc_core.manifest import Manifest

        manifest = Manifest.from_bytes((path / "manifest.json").read_bytes(), source=str(path))
        spec = ModelConfig(**manifest.model.model_dump())
        model = build_model(
            spec.name,
            num_classes=spec.num_classes,
            in_channels=spec.in_channels,  # type: ignore[arg-type]
            image_size=spec.image_size,
            **spec.kwargs,
        )  # type: ignore[arg-type]
        model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
        return model, spec
    model, cfg = ckpt.load_model(ckpt.resolve_checkpoint(path))
    return model, cfg.model


def prepare_model(path: Path, trainable: str) -> tuple[nn.Module, ModelConfig]:
    model, spec = load_upstream(path)
    apply_trainable(model, trainable)
    return model, spec


# ---------------------------------------------------------------------------------------------
# The job


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
    precision = pick_precision(job, profile, device)
    budget = (
        job.budget_mb if job.budget_mb is not None else float(profile.memory.training_budget_mb)
    )
    job.out.mkdir(parents=True, exist_ok=True)

    plan = None
    micro = job.micro_batch
    if micro is None:
        from agent.memory_plan import plan_micro_batch

        plan = plan_micro_batch(
            build_config(job, upstream, precision, None), init, job.trainable, budget, device
        )
        micro = plan.micro_batch_size
    cfg = build_config(job, upstream, precision, micro)
    if job.activation_checkpointing:
        enable_activation_checkpointing(model)
    trainer = Trainer(cfg, model=model, hooks=hooks or [])
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


def _main(job_json: str) -> None:
    """``python -m agent.finetune JOB_JSON``: one job in a process of its own, so its peak
    RSS is its own; prints the report plus that peak (``rss_mb``) as one JSON line."""
    import resource

    result = run_finetune(FinetuneJob.model_validate_json(job_json))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({**result.report, "rss_mb": rss_mb}))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1])
