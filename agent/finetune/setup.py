"""A fine-tune's set-up, resolved once: profile, device, precision, budget, the TrainConfig
and the memory plan that fixes its micro-batch.

:func:`resolve_setup` is the one place these are decided, for the standalone fine-tune
(``python -m agent.finetune``, which plans in its own process) and the device job (whose
``setup`` child resolves it, whose torch-free worker plans against the whole process tree,
and whose fine-tune child trains on exactly that :class:`FinetuneSetup`, never building
another). The module itself is torch-free: only :func:`resolve_setup` imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from agent.finetune.job import FinetuneJob
from hpc_core.config import ModelConfig, TrainConfig, config_from_dict


class FinetuneSetup(BaseModel):
    """Everything the trainer is built from, JSON-safe so it crosses the job's processes."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    profile: str
    """The board profile's name (``auto`` already detected)."""
    device: str
    """``cpu`` or ``cuda``."""
    precision: str
    budget_mb: float
    """The job's memory budget, or its profile's training budget."""
    checkpoint: Path
    """The weights the fine-tune starts from (a slot, or a resolved hpc_core checkpoint)."""
    config: dict[str, Any]
    """``TrainConfig.to_dict()``; ``training.micro_batch_size`` is set once planned."""
    plan: dict[str, Any] | None = None
    """The memory plan that chose the micro-batch (``MemoryPlan.to_dict()``); None when the
    job gave one."""

    @property
    def planned(self) -> bool:
        return self.config["training"].get("micro_batch_size") is not None

    def train_config(self) -> TrainConfig:
        return config_from_dict(self.config, source="fine-tune set-up")

    def with_plan(self, plan: dict[str, Any]) -> FinetuneSetup:
        """This set-up with the planned micro-batch (accumulation follows from it)."""
        training = {**self.config["training"], "micro_batch_size": plan["micro_batch_size"]}
        return self.model_copy(update={"config": {**self.config, "training": training},
                                       "plan": plan})


def build_config(
    job: FinetuneJob, upstream: ModelConfig, precision: str, micro: int | None
) -> TrainConfig:
    """The fine-tune as an hpc_core training config: the same loop as upstream."""
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
                "proximal_mu": job.proximal_mu,
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


def resolve_profile(name: str) -> Any:
    from device_profiles import detect_profile, load_profile

    return detect_profile() if name == "auto" else load_profile(name)


def pick_precision(job: FinetuneJob, profile: Any, device: str) -> str:
    if job.precision != "auto":
        return job.precision
    if device != "cuda":
        return "fp32"
    return "bf16" if profile.precision.bf16 else ("fp16" if profile.precision.fp16 else "fp32")


def resolve_setup(job: FinetuneJob, upstream: ModelConfig | None = None, *,
                  plan: bool = True) -> FinetuneSetup:
    """Decide the fine-tune's set-up from the job and the board. ``upstream``: the model's
    spec when the caller has loaded it (read from the checkpoint otherwise). ``plan``: probe
    for the micro-batch here, against this process's own budget (the standalone fine-tune);
    the device job passes False and plans in its worker against the whole process tree."""
    import torch

    from hpc_core import checkpoint as ckpt

    profile = resolve_profile(job.profile)
    if job.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("finetune.device=cuda but no CUDA device is visible here: use auto "
                         "(CUDA where there is one) or cpu")
    device = "cuda" if job.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    slot = (job.checkpoint / "manifest.json").is_file()
    init = job.checkpoint if slot else ckpt.resolve_checkpoint(job.checkpoint)
    if upstream is None:
        from agent.finetune.model import load_upstream

        _, upstream = load_upstream(init)
    precision = pick_precision(job, profile, device)
    budget = (job.budget_mb if job.budget_mb is not None
              else float(profile.memory.training_budget_mb))
    setup = FinetuneSetup(
        profile=profile.name, device=device, precision=precision, budget_mb=budget,
        checkpoint=init,
        config=build_config(job, upstream, precision, job.micro_batch).to_dict())
    if plan and not setup.planned:
        from agent.finetune.memory_plan import plan_micro_batch

        found = plan_micro_batch(setup.train_config(), init, job.trainable, budget,
                                 device=device)
        setup = setup.with_plan(found.to_dict())
    return setup
