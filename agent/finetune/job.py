"""The fine-tune job as a device accepts it: from ``agentctl finetune`` flags, a job file, or
the daemon's fine-tune command. Torch-free, so the daemon and the CLI parser can import it."""

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

from agent.pacing.app_latency import AppLatencySource
from agent.spool.index import count_kept

TRAINABLE_RE = re.compile(r"^(head|all|last_n:([1-9][0-9]*))$")
PROFILE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
"""A device profile's name: the file ``device_profiles/NAME.yaml``, never a path."""


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

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    checkpoint: Path
    """The upstream model: an hpc_core checkpoint or run directory, or an installed slot."""
    data: Path
    """The device's data: a folder of class sub-folders (PNG/JPEG) or an .npz with x and y."""
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
    """Share of the device data held out to measure accuracy before and after."""
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
    try:
        samples = count_kept(root)
    except OSError as e:
        return f"the spool {root} cannot be read: {e}"
    return too_few_samples(samples, f"the spool {root}", effective_batch, val_fraction)


@dataclass
class FinetuneResult:
    report: dict[str, Any]
    checkpoint_dir: Path | None
