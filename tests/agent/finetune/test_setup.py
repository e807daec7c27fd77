"""The fine-tune's set-up without torch: where it answers and where it leaves the question to
torch (the device job's ``setup`` child). That both paths agree on a real slot is checked in
tests/agent/jobs/test_finetune_setup.py, where the device jobs' upstream is at hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.finetune.job import FinetuneJob
from agent.finetune.setup import gpu_device_nodes, setup_without_torch
from registry.errors import InvalidManifestError


def _job(tmp_path: Path, checkpoint: Path, **over: object) -> FinetuneJob:
    data = tmp_path / "data.npz"
    data.write_bytes(b"")
    return FinetuneJob.model_validate({"checkpoint": str(checkpoint), "data": str(data),
                                       "out": str(tmp_path / "out"), "profile": "generic-x86",
                                       **over})


def test_gpu_device_nodes_finds_any_of_the_patterns(tmp_path: Path) -> None:
    patterns = (str(tmp_path / "nvidia*"), str(tmp_path / "nvhost-*"), str(tmp_path / "nvmap"))
    assert gpu_device_nodes(patterns) == []
    (tmp_path / "nvhost-ctrl-gpu").touch()
    (tmp_path / "nvmap").touch()
    assert gpu_device_nodes(patterns) == [str(tmp_path / "nvhost-ctrl-gpu"),
                                          str(tmp_path / "nvmap")]


@pytest.mark.parametrize(("device", "node", "why"), [
    ("auto", True, "a GPU device node: only torch can say whether CUDA is visible"),
    ("cuda", False, "device cuda: the child's refusal names the fix"),
    ("cuda", True, "device cuda: the child checks the device is visible"),
])
def test_torch_decides_where_cuda_may_be_asked_for(tmp_path: Path, device: str, node: bool,
                                                     why: str) -> None:
    slot = tmp_path / "slot"
    slot.mkdir()
    (slot / "manifest.json").write_text(json.dumps({"not": "read on this path"}))
    nodes = tmp_path / "dev"
    nodes.mkdir()
    if node:
        (nodes / "nvidia0").touch()
    job = _job(tmp_path, slot, device=device)
    assert setup_without_torch(job, nodes=(str(nodes / "nvidia*"),)) is None, why


def test_a_checkpoint_that_is_not_a_slot_is_read_by_torch(tmp_path: Path) -> None:
    run = tmp_path / "run"  # an hpc_core run: its spec is in a checkpoint torch reads
    run.mkdir()
    job = _job(tmp_path, run, device="cpu")
    assert setup_without_torch(job, nodes=()) is None


def test_a_slot_manifest_that_does_not_parse_is_refused(tmp_path: Path) -> None:
    # The device job's worker then hands the job to its setup child, which reports it.
    slot = tmp_path / "slot"
    slot.mkdir()
    (slot / "manifest.json").write_text("{}")
    with pytest.raises(InvalidManifestError):
        setup_without_torch(_job(tmp_path, slot, device="cpu"), nodes=())
