"""The Ray worker processes' start-up hook of ``hpc-train tune --backend ray``
(``runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK}``).

A trial's first seconds in a fresh worker went to imports: torch (~1.4 s) and, at the first
optimizer built, ``torch._dynamo`` (~1.1 s). Ray starts a job's workers ahead of its first
tasks, so importing them here overlaps that with the driver setting the experiment up instead
of adding it to the first trial of each worker.
"""

from __future__ import annotations

WORKER_SETUP_HOOK = "hpc_core.tune.ray_worker.prepare_worker"


def prepare_worker() -> None:
    """Import what every trial imports (the trainer, torch and its compiler front end)."""
    import torch._dynamo  # noqa: F401  imported by torch.optim at its first optimizer

    import hpc_core.trainer  # noqa: F401
