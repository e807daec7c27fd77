"""The ``evaluate`` job: a registry version scored on this device's held-out data without
installing it (fleet learning's federated evaluation: upstream asks the devices how a
candidate base does on their data before it publishes it).

    evaluate: pull (verified into the job folder, never a slot) -> evaluate -> done

As received (:class:`EvaluateArgs`: names only) and as the worker runs it
(:class:`EvaluateJob`: the data set resolved under the device's data_root, the registry and
trusted keys from agent.yaml); ``agent.jobs.resolve.resolve`` turns one into the other.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agent.finetune.job import PersonalPart
from agent.jobs.names import ModelName, Name, Version


class EvaluateOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    baseline: Version | None = None
    """A version to score beside it on the same samples (e.g. the base the candidate was
    combined from): an installed one, else fetched and verified like the candidate. Null:
    the active model, if any."""
    samples: int | None = Field(default=None, ge=1, le=100_000)
    """Held-out samples to score (null: the whole held-out split)."""
    personal: list[PersonalPart] = Field(default_factory=list, max_length=2)
    """Also score the candidate personalized: with these parts of the device's own model
    (its active one) in place of the candidate's (``head``: FedPer's own classifier;
    ``norm``: FedBN's own normalization), as personalized serving would run it. Empty: not
    scored; a device with no model of its own scores nothing personalized."""


class EvaluateJob(BaseModel):
    """The resolved job the worker runs."""

    model_config = ConfigDict(extra="forbid")

    model: str
    version: str
    """The version to score (a candidate: never installed by this job)."""
    data: Path
    """Labelled device data; the held-out split a fine-tune of it would hold out is scored."""
    evaluate: EvaluateOptions = Field(default_factory=EvaluateOptions)
    registry: str | None = None
    """Where a version not on the device is fetched from (agent.yaml registry.url)."""
    trusted_keys: Path | None = None

    def skipped_steps(self) -> set[str]:
        return set()


class EvaluateArgs(BaseModel):
    """The ``evaluate`` command's args: names only; the device decides every path."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName
    version: Version
    data: Name
    """Name of a labelled data set under the device's data_root."""
    evaluate: EvaluateOptions = Field(default_factory=EvaluateOptions)
