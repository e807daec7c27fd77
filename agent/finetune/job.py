"""The fine-tune job: what a device accepts (:class:`FinetuneJob`, from ``agentctl finetune``
flags, a job file or the daemon's fine-tune command), what it resolves to on this board
(:class:`FinetuneSetup`: profile, device, precision, budget, the ``TrainConfig`` and the memory
plan that fixes its micro-batch), and what it returns (:class:`FinetuneResult`).

Torch-free, so the daemon and the CLI parser can import it. A set-up is built in one place,
``agent.finetune.setup.setup_on``, once the device and the checkpoint's spec are known: by
``agent.finetune.recipe.resolve_setup`` (torch: asks about CUDA, reads any checkpoint), used by
the standalone fine-tune (``python -m agent.finetune``, which plans in its own process) and the
device job's ``setup`` child, and by ``agent.finetune.setup.setup_without_torch`` in the device
job's worker where torch has nothing to decide (an installed slot, no GPU on the host). The
worker plans against the whole process tree, and the fine-tune child trains on exactly that
set-up, never building another."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from agent.finetune.data_source import data_source
from agent.pacing.app_latency import AppLatencySource
from hpc_core.config import TrainConfig, config_from_dict
from registry.model_config import ModelConfig

TRAINABLE_RE = re.compile(r"^(head|all|last_n:([1-9][0-9]*))$")
PROFILE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
"""A device profile's name: the file ``device_profiles/NAME.yaml``, never a path."""
PersonalPart = Literal["head", "norm"]
"""A device's own part of a model (``agent.finetune.personal``): its head, its normalization."""


def _profile_name(v: str) -> str:
    # load_profile joins the name under its folder: "/tmp/x" or "../x" would escape it.
    if not PROFILE_NAME_RE.fullmatch(v):
        raise ValueError(f"profile {v!r} is not a profile name (auto, or one of "
                         "`agentctl profiles`: lower-case letters, digits, . _ -)")
    return v


# In the annotation, not a validator method: the device job's option models copy fields only.
ProfileName = Annotated[str, AfterValidator(_profile_name)]


class FinetuneJob(BaseModel):
    """What `agentctl finetune` and the daemon's fine-tune command accept."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Path
    """The upstream model: an hpc_core checkpoint or run directory, or an installed slot."""
    data: Path
    """The device's data: for a classifier a folder of class sub-folders (PNG/JPEG) or an .npz
    with x and y; for a detector a COCO or a YOLO folder."""
    out: Path
    """Job directory: metrics.jsonl, checkpoints/, report.json, report.png."""
    profile: ProfileName = "auto"
    """Device profile name (``agentctl profiles``), or auto (detect from
    /proc/device-tree/model). A name, never a path: profiles load from the package's folder."""
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
    proximal_mu: float = Field(default=0.0, ge=0)
    """FedProx: pull the weights towards the upstream's by (mu / 2) * ||w - w_upstream||^2, so
    devices with unlike data drift less apart before the fleet combines them (0 = off;
    0.001-0.1 are usual)."""
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
    """Share of the device data held out to measure the model's gate metric (accuracy, mAP)
    before and after."""
    seed: int = 0
    sensors: Literal["auto", "jtop", "tegrastats", "sysfs", "sim", "none"] = "auto"
    """Sensor backend for the thermal/power governor (none: no pacing)."""
    switch_power_modes: bool = False
    """Let the governor switch nvpmodel power modes when a lower-clocked mode gives more steps/s
    inside the limits (needs root or the jetson-stats service; the report says when neither
    is there)."""
    yield_to_app: bool = True
    """Pace training by the application's inference latency where a serving runtime of the
    model reports one (training yields while its p99 is over the SLO)."""
    app_latency: AppLatencySource | None = None
    """Where that latency is read (the device job sets it: the state dir's serving runtimes;
    null: no application to yield to)."""
    sim_time_scale: float = Field(default=1.0, gt=0)
    """With sensors=sim: simulated seconds per real second (60 shows a board heating up
    within a short demo job)."""

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


def min_samples(effective_batch: int, val_fraction: float) -> int:
    """The fewest samples whose training split (what hpc_core.data.split_indices leaves after
    holding out val_fraction) still fills one optimizer step of effective_batch."""
    n = effective_batch + 1
    while n - max(1, round(n * val_fraction)) < effective_batch:
        n += 1
    return n


def too_few_samples(samples: int, what: str, effective_batch: int,
                    val_fraction: float) -> str | None:
    """Why ``samples`` (held by ``what``) cannot feed one optimizer step, or None."""
    need = min_samples(effective_batch, val_fraction)
    if samples >= need:
        return None
    return (f"{what} holds {samples} labelled samples; a fine-tune needs at least {need} "
            f"(finetune.effective_batch={effective_batch} training samples once "
            f"finetune.val_fraction={val_fraction:g} is held out): let the device record "
            "more, or lower finetune.effective_batch")


def spool_too_small(root: Path, effective_batch: int, val_fraction: float) -> str | None:
    """Why the spool at ``root`` cannot feed one optimizer step now (or cannot be read), or
    None: the check when a job is submitted (the fine-tune's snapshot checks again)."""
    # Here, not at the top: the spool's index imports numpy, and every process that reads a
    # job spec (the daemon, agentctl, each step's child) imports this module.
    from agent.spool.index import count_kept

    try:
        samples = count_kept(root)
    except OSError as e:
        return f"the spool {root} cannot be read: {e}"
    return too_few_samples(samples, f"the spool {root}", effective_batch, val_fraction)


@dataclass
class FinetuneResult:
    report: dict[str, Any]
    checkpoint_dir: Path | None


class FinetuneSetup(BaseModel):
    """Everything the trainer is built from, JSON-safe so it crosses the job's processes."""

    model_config = ConfigDict(extra="forbid")

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
    """The fine-tune as an hpc_core training config: the same loop as upstream, on the upstream
    model's task (the device data's layout picks its source: :func:`data_source`)."""
    source = data_source(job.data, upstream.task)
    return config_from_dict(
        {
            "task": upstream.task,
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
