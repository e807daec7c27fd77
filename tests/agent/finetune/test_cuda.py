"""The on-device fine-tune on CUDA (a Jetson's GPU; here any CUDA device): the precision the
profile allows, a memory plan that counts RSS plus what the CUDA allocator reserved (one budget
on unified memory), and the adaptation itself. Skipped, with the reason, where no CUDA device
is visible; on such a host a job that asks for CUDA is refused before anything runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from agent.finetune.job import FinetuneJob
from agent.finetune.recipe import resolve_setup, run_finetune
from hpc_core.config import load_config
from hpc_core.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
from make_device_data import make_device_data  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device on this host: the fine-tune's GPU path (make test-gpu on a GPU host "
    "or a Jetson runs it)",
)


def _upstream(out: Path) -> Path:
    Trainer(load_config(REPO / "configs/digits.yaml", [
        f"run.output_dir={out}", "data.image_size=16", "logging.progress=off",
        "model.kwargs={width: 16, norm: batch}", "training.max_steps=80",
    ])).train()
    return out


@needs_cuda
def test_a_finetune_on_cuda_learns_inside_a_budget_of_rss_plus_gpu_memory(tmp_path: Path) -> None:
    up = _upstream(tmp_path / "up")
    data = make_device_data(tmp_path / "device.npz", ["invert", "noise"], image_size=16)
    job = FinetuneJob(checkpoint=up, data=data, out=tmp_path / "job", profile="generic-x86",
                      trainable="all", epochs=3, lr=2e-3, device="cuda",
                      budget_mb=4096)
    report = run_finetune(job).report
    assert report["device"] == "cuda"
    assert report["precision"] == "bf16"  # generic-x86 has bf16; fp32 would be the CPU's
    plan = report["memory_plan"]
    assert plan["method"].startswith("probe subprocess peak RSS + CUDA reserved"), plan
    # Every probe counted the process's RSS (hundreds of MB with torch and the CUDA context)
    # plus the allocator's reservation: more than the allocator's own count would say.
    assert min(min(v) for v in plan["probes"].values()) > 100, plan
    assert plan["predicted_tree_peak_mb"] <= 4096
    gain = report["accuracy_after"] - report["accuracy_before"]
    assert gain >= 0.20, {k: report[k] for k in (
        "accuracy_before", "accuracy_after", "steps", "micro_batch_size", "memory_plan")}


def test_a_finetune_that_asks_for_cuda_where_there_is_none_is_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU host too: hide it, the refusal is what a CPU-only board must give.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    up = _upstream(tmp_path / "up")
    data = make_device_data(tmp_path / "device.npz", ["invert"], image_size=16)
    job = FinetuneJob(checkpoint=up, data=data, out=tmp_path / "job", profile="generic-x86",
                      device="cuda")
    with pytest.raises(ValueError, match=r"finetune\.device=cuda but no CUDA device"):
        resolve_setup(job, plan=False)
