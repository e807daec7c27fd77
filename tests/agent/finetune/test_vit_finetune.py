"""The vit family through the device fine-tune: trainable scopes, activation checkpointing, and a
budget-planned run of a vit checkpoint (``python -m agent.finetune``, as the device runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent.finetune.model import apply_trainable, enable_activation_checkpointing
from hpc_core.config import config_from_dict
from hpc_core.models import build_model
from hpc_core.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
from make_device_data import make_device_data  # noqa: E402

SIZE = 32  # patch 4 by default: 64 tokens, so attention is a real share of the memory


def _vit_upstream(out: Path) -> Path:
    """A vit checkpoint from two steps on clean digits: the run tests the plan, not accuracy."""
    cfg = config_from_dict({
        "run": {"name": "vit-upstream", "output_dir": str(out), "seed": 0},
        "data": {"source": "digits", "image_size": SIZE},
        "model": {"name": "vit"},
        "training": {"global_batch_size": 64, "max_steps": 2, "device": "cpu"},
        "checkpoint": {"best_metric": None},
        "logging": {"progress": "off"},
        "faults": {"handle_signals": False},
    })
    Trainer(cfg).train()
    return out


def _finetune(up: Path, data: Path, out: Path, extra: dict) -> dict:
    kw = {
        "checkpoint": str(up), "data": str(data), "out": str(out), "profile": "generic-x86",
        "trainable": "all", "steps": 2, "effective_batch": 256, "optimizer": "sgd",
        "lr": 0.05, **extra,
    }
    # A process of its own: its peak RSS is the job's alone, as on the device.
    p = subprocess.run(
        [sys.executable, "-m", "agent.finetune", json.dumps(kw)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# Eight processes that each import torch (two jobs, six memory probes): ~40 s of CPU.
@pytest.mark.slow
def test_vit_finetune_fits_the_budget_and_keeps_the_result(tmp_path: Path) -> None:
    # LayerNorm normalizes each token of each sample alone, so accumulating micro-batches must
    # give the full batch's step; SGD, as Adam's m/sqrt(v) magnifies float rounding.
    up = _vit_upstream(tmp_path / "up")
    data = make_device_data(tmp_path / "device.npz", ["invert"], image_size=SIZE)
    unbounded = _finetune(up, data, tmp_path / "free", {"micro_batch": 256})
    # 450 MB: the unbounded run peaks ~530 MB here (~275 MB fixed + ~1 MB/sample).
    budget = 450.0
    bounded = _finetune(up, data, tmp_path / "bound", {"budget_mb": budget})
    assert unbounded["rss_mb"] > budget, unbounded
    assert bounded["rss_mb"] <= 1.05 * budget, bounded
    plan = bounded["memory_plan"]
    assert bounded["micro_batch_size"] < 256 and plan["accumulation_steps"] > 1, plan
    start = load_file(str(up / "checkpoints/final/model.safetensors"))
    a = load_file(str(tmp_path / "free/checkpoints/final/model.safetensors"))
    b = load_file(str(tmp_path / "bound/checkpoints/final/model.safetensors"))
    assert a.keys() == b.keys() == start.keys()
    assert any(not torch.equal(a[k], start[k]) for k in a), "the fine-tune did not step"
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0, msg=k)


def test_vit_trainable_scopes_count_the_head_and_the_last_block() -> None:
    m = build_model("vit", num_classes=10, in_channels=1, image_size=8)
    head = apply_trainable(m, "head")
    assert head == sum(p.numel() for p in m.head.parameters())
    # The last block's fc2, then everything registered after it: the final norm and the head.
    last2 = apply_trainable(m, "last_n:2")
    fc2 = m.blocks[-1].mlp[-1]
    assert last2 == head + sum(p.numel() for p in [*fc2.parameters(), *m.norm.parameters()])
    assert not m.pos_embed.requires_grad and not m.patch_embed.weight.requires_grad
    assert apply_trainable(m, "all") == sum(p.numel() for p in m.parameters())


def test_vit_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    a = build_model("vit", num_classes=10, in_channels=1, image_size=8)
    b = build_model("vit", num_classes=10, in_channels=1, image_size=8)
    b.load_state_dict(a.state_dict())
    # Every transformer block (children of model.blocks) is recomputed in backward.
    assert enable_activation_checkpointing(b) >= len(b.blocks)
    assert a.state_dict().keys() == b.state_dict().keys()
    x = torch.randn(4, 1, 8, 8)
    a(x).sum().backward()
    b(x).sum().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, msg=n)
