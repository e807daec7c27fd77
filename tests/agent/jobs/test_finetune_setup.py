"""The fine-tune step's set-up on a real installed slot: the worker's torch-free answer is the
one the ``setup`` child (torch) gives. That a planned job on a host without a GPU starts no
set-up child is checked by the budget runs (tests/agent/jobs/test_budget_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.finetune.job import FinetuneJob
from agent.finetune.setup import gpu_device_nodes, setup_without_torch
from agent.storage.slots import ModelSlots
from tests.agent.jobs.conftest import Device


@pytest.mark.parametrize("over", [
    {"micro_batch": None},
    {"micro_batch": 16, "effective_batch": 32, "budget_mb": 600},
    {"micro_batch": None, "profile": "jetson-orin-nano-8gb", "device": "cpu", "precision": "auto"},
], ids=["planned", "micro-batch-given", "a-jetson-profile-on-cpu"])
def test_the_torch_free_set_up_is_the_childs(device: Device, tmp_path: Path,
                                             over: dict[str, object]) -> None:
    from agent.finetune.recipe import resolve_setup

    device.install()
    slot = ModelSlots(device.state, device.model).active()
    assert slot is not None
    ft = {**device.base_spec()["finetune"], **over}
    job = FinetuneJob.model_validate({**ft, "checkpoint": str(slot.path),
                                      "data": str(device.data), "out": str(tmp_path / "out")})
    mine = setup_without_torch(job, nodes=())
    assert mine is not None
    if not gpu_device_nodes():  # torch's answer is the CPU's here too
        assert mine == resolve_setup(job, plan=False)

