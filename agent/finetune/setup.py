"""The fine-tune's set-up decided: board profile, device, precision, budget and the
``TrainConfig`` (:class:`agent.finetune.job.FinetuneSetup`), torch-free where the host leaves
nothing for torch to decide.

Two things of a set-up can need torch: whether CUDA is visible (``device: auto`` or ``cuda``)
and the spec of a checkpoint that is not an installed slot (an hpc_core run, read through
torch). :func:`setup_without_torch` decides the rest without it: a device job's worker calls
it, and only where it answers None does the job start its ``setup`` child, a fresh process
that imports torch to ask (~1.4 CPU s on the 2-core x86 test host, before its first useful
line). A host with no GPU device node has no CUDA whatever torch build is installed: the CUDA
driver reaches a GPU only through one (:data:`GPU_DEVICE_NODES`), so there the answer is the
CPU without asking. :func:`setup_on` is the one place both paths build the set-up from, so
they cannot drift apart.
"""

from __future__ import annotations

import glob
from pathlib import Path

from agent.finetune.job import (
    FinetuneJob,
    FinetuneSetup,
    build_config,
    pick_precision,
    resolve_profile,
)
from registry.model_config import ModelConfig

GPU_DEVICE_NODES = ("/dev/nvidia*", "/dev/nvhost-*", "/dev/nvgpu*", "/dev/nvmap", "/dev/dxg",
                    "/dev/kfd")
"""Device nodes through which a GPU runtime reaches its GPU: a discrete NVIDIA GPU's
(``/dev/nvidia0``, ``/dev/nvidiactl``), a Jetson's integrated one (``/dev/nvhost-*``,
``/dev/nvgpu``, ``/dev/nvmap``), WSL2's paravirtual GPU (``/dev/dxg``) and ROCm's (``/dev/kfd``,
which torch also reports as CUDA). Any one of them present, and torch is asked."""


def gpu_device_nodes(patterns: tuple[str, ...] = GPU_DEVICE_NODES) -> list[str]:
    """The GPU device nodes this host has (none: no CUDA device can be visible here)."""
    return sorted(p for pattern in patterns for p in glob.glob(pattern))


def setup_on(job: FinetuneJob, upstream: ModelConfig, checkpoint: Path,
             device: str) -> FinetuneSetup:
    """``job``'s set-up on ``device`` (already resolved: ``cpu`` or ``cuda``), fine-tuning
    ``checkpoint`` whose model is ``upstream``; unplanned unless the job gave a micro-batch."""
    profile = resolve_profile(job.profile)
    precision = pick_precision(job, profile, device)
    budget = (job.budget_mb if job.budget_mb is not None
              else float(profile.memory.training_budget_mb))
    return FinetuneSetup(
        profile=profile.name, device=device, precision=precision, budget_mb=budget,
        checkpoint=checkpoint,
        config=build_config(job, upstream, precision, job.micro_batch).to_dict())


def setup_without_torch(job: FinetuneJob,
                        nodes: tuple[str, ...] = GPU_DEVICE_NODES) -> FinetuneSetup | None:
    """``job``'s set-up (unplanned), decided without importing torch, or None where only
    torch can decide it: the checkpoint is not an installed slot, or the job may run on CUDA
    (``device: cuda``, or ``auto`` on a host with a GPU device node). What it returns is what
    ``agent.finetune.recipe.resolve_setup(job, plan=False)`` returns on the same host."""
    manifest = job.checkpoint / "manifest.json"
    if not manifest.is_file():
        return None
    if job.device == "cuda" or (job.device == "auto" and gpu_device_nodes(nodes)):
        return None
    from registry.manifest import Manifest

    upstream = Manifest.from_bytes(manifest.read_bytes(), source=str(job.checkpoint)).model
    return setup_on(job, upstream, job.checkpoint, "cpu")
