"""What ``python -m fleet.sim`` simulates: ``SimConfig`` (how many devices, their ids, groups
and starting model, telemetry) and ``Behavior`` (how one device's jobs go: duration, failure,
a device-side gate rollback, refusal, deferral, accuracy delta), with the deterministic
``fail_share`` that tells a test which devices fail.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Behavior(BaseModel):
    """How one simulated device's jobs go."""

    model_config = ConfigDict(extra="forbid")

    job_duration_s: float = Field(default=0.5, ge=0)
    fail: bool = False
    """finetune/deploy end FAILED (JOB_FAILED)."""
    gate_rollback: bool = False
    """The device's own gates refuse the new model: SUCCEEDED with outcome rolled_back."""
    reject: bool = False
    """finetune/deploy are REJECTED (BAD_ARGS) at once."""
    metric: str = "eval/acc"
    acc_before: float = 0.95
    acc_delta: float = 0.0
    """after - before of ``metric`` for a finished job (negative = the model got worse)."""
    rollback_duration_s: float = Field(default=0.05, ge=0)
    defer: int = Field(default=0, ge=0)
    """Answer DEFERRED (busy fine-tuning) to the first this-many deliveries of each finetune,
    deploy or evaluate command, keeping no record of it, as the agent does while busy."""
    defer_recheck_s: float = Field(default=1.0, ge=1, le=3600)
    """The ``recheck_after_s`` of those DEFERRED results."""


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    devices: int = Field(default=10, ge=1, le=100_000)
    id_prefix: str = "sim"
    first_index: int = Field(default=0, ge=0)
    """Numbering starts here, so several processes (or certificates) share one id space."""
    groups: list[str] = Field(default_factory=lambda: ["sim"])
    model_name: str = "digits"
    model_version: str = "v1"
    behavior: Behavior = Field(default_factory=Behavior)
    fail_share: float = Field(default=0.0, ge=0, le=1)
    """This share of devices fails its jobs: every k-th by index (deterministic, so a test
    knows which ones; with 0.2 the 5th, 10th, ... device)."""
    overrides: dict[str, Behavior] = Field(default_factory=dict)
    """Per device id, replacing the behavior above."""
    telemetry_s: float = Field(default=0.0, ge=0)
    """Telemetry period (0: none)."""

    def device_ids(self) -> list[str]:
        last = self.first_index + self.devices
        width = max(4, len(str(last - 1)))
        return [f"{self.id_prefix}-{i:0{width}d}" for i in range(self.first_index, last)]

    def behavior_of(self, index: int, device: str) -> Behavior:
        if device in self.overrides:
            return self.overrides[device]
        fails = int((index + 1) * self.fail_share) > int(index * self.fail_share)
        return self.behavior.model_copy(update={"fail": True}) if fails else self.behavior
