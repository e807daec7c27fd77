"""On-device fine-tuning through hpc_core.Trainer: memory budget, trainable scope, adaptation."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent.finetune import memory_plan
from agent.finetune.job import FinetuneJob
from agent.finetune.memory_plan import BudgetTooSmall, fit_plan, plan_micro_batch
from agent.finetune.memory_probes import Probe
from agent.finetune.model import apply_trainable, enable_activation_checkpointing
from agent.finetune.recipe import run_finetune
from hpc_core.config import config_from_dict, load_config
from hpc_core.models import build_model
from hpc_core.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
from make_device_data import make_device_data  # noqa: E402


def upstream(out: Path, image_size: int, norm: str, steps: int | None = None) -> Path:
    sets = [
        f"run.output_dir={out}",
        f"data.image_size={image_size}",
        "logging.progress=off",
        f"model.kwargs={{width: 16, norm: {norm}}}",
    ]
    if steps:
        sets.append(f"training.max_steps={steps}")
    Trainer(load_config(REPO / "configs/digits.yaml", sets)).train()
    return out


def test_device_distortion_is_learned(tmp_path: Path) -> None:
    """Upstream small_cnn on clean digits, fine-tuned on inverted + noisy device images."""
    up = upstream(tmp_path / "up", 16, "batch")
    data = make_device_data(tmp_path / "device.npz", ["invert", "noise"], image_size=16)
    job = FinetuneJob(
        checkpoint=up,
        data=data,
        out=tmp_path / "job",
        profile="generic-x86",
        trainable="all",
        epochs=3,
        lr=2e-3,
        micro_batch=64,
    )
    report = run_finetune(job).report
    gain = report["accuracy_after"] - report["accuracy_before"]
    assert gain >= 0.20, report
    saved = json.loads((tmp_path / "job/report.json").read_text())
    assert saved["accuracy_after"] == report["accuracy_after"]
    assert saved["profile"] == "generic-x86" and saved["precision"] == "fp32"


def _finetune_in_subprocess(up: Path, data: Path, out: Path, extra: dict) -> dict:
    kw = {
        "checkpoint": str(up),
        "data": str(data),
        "out": str(out),
        "profile": "generic-x86",
        "trainable": "all",
        "steps": 4,
        "effective_batch": 256,
        "optimizer": "sgd",
        "lr": 0.05,
        **extra,
    }
    p = subprocess.run(
        [sys.executable, "-m", "agent.finetune", json.dumps(kw)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_budget_bounds_peak_rss_and_keeps_the_result(tmp_path: Path) -> None:
    # GroupNorm normalizes each sample alone, so micro-batching cannot change the result.
    # SGD: Adam's m/sqrt(v) would blow float rounding in near-zero gradients up to ~lr.
    up = upstream(tmp_path / "up", 48, "group", steps=2)
    data = make_device_data(tmp_path / "device.npz", ["invert"], image_size=48)
    unbounded = _finetune_in_subprocess(up, data, tmp_path / "free", {"micro_batch": 256})
    # 600 MB: the unbounded run peaks ~750 MB here (its cold library pages dropped), so the
    # budget has to bind by a clear margin.
    budget = 600.0
    bounded = _finetune_in_subprocess(up, data, tmp_path / "bound", {"budget_mb": budget})
    assert unbounded["rss_mb"] > budget, unbounded
    assert bounded["rss_mb"] <= 1.05 * budget, bounded
    assert bounded["micro_batch_size"] < 256 and bounded["memory_plan"]["accumulation_steps"] > 1
    a = load_file(str(tmp_path / "free/checkpoints/final/model.safetensors"))
    b = load_file(str(tmp_path / "bound/checkpoints/final/model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0)


def test_fit_plan_picks_the_largest_divisor_that_fits() -> None:
    points = {4: [404.0, 404.0], 8: [412.0, 412.0], 16: [428.0, 428.0]}  # 396 MB + 2 MB/sample
    plan = fit_plan(1000, 256, points, "test")
    assert plan.per_sample_mb == pytest.approx(2.0) and plan.base_mb == pytest.approx(396.0)
    # (1000 - 396) / 2 = 302 samples fit -> capped at the effective batch.
    assert plan.micro_batch_size == 256 and plan.accumulation_steps == 1
    plan = fit_plan(600, 256, points, "test")  # (600 - 396) / 2 = 102 -> the divisor 64
    assert plan.micro_batch_size == 64 and plan.accumulation_steps == 4
    assert plan.predicted_tree_peak_mb <= 600
    with pytest.raises(BudgetTooSmall, match=r"finetune\.budget_mb=300: .* raise the budget"):
        fit_plan(300, 256, points, "test")


def test_fit_plan_keeps_the_noise_and_the_job_process_off_the_budget() -> None:
    # Repeats 4 MB apart at 16: the line goes through the worst of each, the spread is margin.
    points = {4: [404.0, 403.0], 8: [412.0, 411.0], 16: [428.0, 424.0]}
    quiet = fit_plan(600, 256, {m: [max(v)] * 2 for m, v in points.items()}, "test")
    noisy = fit_plan(600, 256, points, "test")
    assert noisy.margin_mb == pytest.approx(4.0) and quiet.margin_mb == 0
    assert noisy.base_mb == quiet.base_mb and noisy.per_sample_mb == quiet.per_sample_mb
    # A 100 MB worker beside the fine-tune: (600 - 100 - 4 - 396) / 2 = 50 -> 32.
    tree = fit_plan(600, 256, points, "test", job_process_mb=100.0)
    assert tree.micro_batch_size == 32 and tree.accumulation_steps == 8
    assert tree.predicted_tree_peak_mb == pytest.approx(100 + 396 + 2 * 32)
    with pytest.raises(BudgetTooSmall, match="100 MB job process"):
        fit_plan(500, 256, points, "test", job_process_mb=100.0)


def test_the_plan_is_probed_at_the_size_it_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A curve that bends upward past the probed sizes, as RSS did: the line through 4-16 says
    # 1 MB/sample, but 128 samples cost 1.5 MB each.
    def peak(m: int) -> float:
        return 270.0 + 0.9 * m + 0.005 * m * m

    calls: list[tuple[tuple[int, ...], bool]] = []

    def fake_probes(cfg: object, init: Path, trainable: str, sizes: Sequence[int], *,
                    fork: bool) -> dict[int, Probe]:
        calls.append((tuple(sizes), fork))
        return {m: Probe(peak(m), 250.0) for m in sizes}

    monkeypatch.setattr(memory_plan, "run_probes", fake_probes)
    cfg = config_from_dict({
        "run": {"name": "plan", "output_dir": str(tmp_path / "job")},
        "data": {"source": "digits"}, "model": {"name": "small_cnn"},
        "training": {"global_batch_size": 256, "max_steps": 2},
    })
    budget = 450.0
    small = {m: [peak(m)] * 2 for m in (4, 8, 16)}
    unverified = fit_plan(budget, 256, small, "test")
    assert peak(unverified.micro_batch_size) > budget, "the curve must defeat the line"
    cache = tmp_path / "probes.json"
    plan = plan_micro_batch(cfg, tmp_path, "all", budget, cache=cache)
    assert plan.micro_batch_size in plan.probes and plan.micro_batch_size > 16
    assert peak(plan.micro_batch_size) <= budget, plan
    # Each repeat probes the small sizes forked from one start-up; the size the plan picks,
    # near the budget, in fresh processes (no copy-on-write pages beside it).
    assert calls[:2] == [((4, 8, 16), True)] * 2, calls
    verified = calls[2:]
    assert verified and all(len(sizes) == 1 and not fork for sizes, fork in verified), calls
    assert ((plan.micro_batch_size,), False) in verified, calls
    # On CUDA nothing is forked: a parent that touched CUDA poisons its children's.
    calls.clear()
    plan_micro_batch(cfg, tmp_path, "all", budget, device="cuda")
    assert calls[:2] == [((4, 8, 16), False)] * 2 and not any(fork for _, fork in calls), calls
    assert plan.accumulation_steps * plan.micro_batch_size >= 256
    # The verification probes are cached with the rest: planning again probes nothing.
    calls.clear()
    again = plan_micro_batch(cfg, tmp_path, "all", budget, cache=cache)
    assert calls == [] and again.probes_reused and again.micro_batch_size == plan.micro_batch_size

    # A probe the kernel kills (its size out of the line's reach): the plan stays below it.
    def killed_past_100(cfg: object, init: Path, trainable: str, sizes: Sequence[int], *,
                        fork: bool) -> dict[int, Probe]:
        if max(sizes) > 100:
            raise RuntimeError(f"memory probe at micro-batch {max(sizes)} failed: killed")
        return {m: Probe(peak(m), 250.0) for m in sizes}

    monkeypatch.setattr(memory_plan, "run_probes", killed_past_100)
    low = plan_micro_batch(cfg, tmp_path, "all", 10_000.0, cache=tmp_path / "other.json")
    assert low.micro_batch_size <= 100 and low.micro_batch_size in low.probes, low
    # A micro-batch forced at or past a size whose probe never finished is refused, though
    # the line says it fits; below it the line judges.
    assert low.failed and min(low.failed) > 100, low
    assert low.line().peak_mb(256) + low.margin_mb <= 10_000.0
    why = low.refusal(256)
    assert why is not None and "finetune.micro_batch=256 does not fit" in why, why
    assert f"the probe at micro-batch {min(low.failed)} went past the budget or did not " \
        "finish" in why, why
    assert low.refusal(low.micro_batch_size) is None


def test_a_start_up_peak_above_the_small_probes_does_not_flatten_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A freshly installed host (its libraries cached in large folios): the probe process
    peaks at 309 MB while torch starts, above the training steps of the probed sizes
    (267-307 MB), and the step grows 3.3 MB a sample. The line goes through the steps."""
    def step(m: int) -> float:
        return 254.0 + 3.3 * m

    monkeypatch.setattr(memory_plan, "run_probes",
                        lambda cfg, init, trainable, sizes, fork: {
                            m: Probe(step(m), 309.0) for m in sizes})
    cfg = config_from_dict({
        "run": {"name": "plan", "output_dir": str(tmp_path / "job")},
        "data": {"source": "digits"}, "model": {"name": "resnet"},
        "training": {"global_batch_size": 64, "max_steps": 2},
    })
    plan = plan_micro_batch(cfg, tmp_path, "all", 450.0, job_process_mb=70.0)
    assert plan.per_sample_mb == pytest.approx(3.3) and plan.startup_mb == 309.0
    assert plan.micro_batch_size == 32 and plan.accumulation_steps == 2  # (450-70-254)/3.3 = 38
    assert plan.predicted_tree_peak_mb == pytest.approx(70 + step(32))
    assert 70 + max(309.0, step(plan.micro_batch_size)) <= 450
    # Whole-process peaks look flat (309, 309, 309): that line sends the job to 64 samples,
    # whose step alone needs 465 MB.
    flat = fit_plan(450, 64, {m: [max(309.0, step(m))] * 2 for m in (4, 8, 16)}, "whole",
                    job_process_mb=70.0)
    assert flat.per_sample_mb < 0.01 and 70 + step(flat.micro_batch_size) > 450
    # The start-up alone past what the budget leaves: refused, and the message says so.
    steps = {m: [step(m)] * 2 for m in (4, 8, 16)}
    with pytest.raises(BudgetTooSmall, match=r"~379 MB .*309 MB start-up peak"):
        fit_plan(370, 64, steps, "test", job_process_mb=70.0, startup_mb=309.0)
    assert fit_plan(380, 64, steps, "test", job_process_mb=70.0, startup_mb=309.0
                    ).micro_batch_size == 16  # (380-70-254)/3.3 = 16.9


def test_trainable_scopes() -> None:
    m = build_model("small_cnn", num_classes=10, in_channels=1, image_size=8, width=8)
    head = apply_trainable(m, "head")
    assert head == sum(p.numel() for p in m.head.parameters())
    last2 = apply_trainable(m, "last_n:2")
    conv3 = m.features[3]
    assert last2 == head + sum(p.numel() for p in conv3.parameters())
    assert apply_trainable(m, "all") == sum(p.numel() for p in m.parameters())
    with pytest.raises(ValueError, match="only 4 conv/linear layers"):
        apply_trainable(m, "last_n:9")


def test_job_validation_names_the_field(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="trainable"):
        FinetuneJob(checkpoint=tmp_path, data=tmp_path, out=tmp_path, trainable="last_n:0")
    with pytest.raises(ValidationError, match="budget_mb"):
        FinetuneJob(checkpoint=tmp_path, data=tmp_path, out=tmp_path, budget_mb=-5)
    with pytest.raises(ValidationError, match="extra"):
        FinetuneJob(checkpoint=tmp_path, data=tmp_path, out=tmp_path, budget=5)


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    a = build_model("small_cnn", num_classes=10, in_channels=1, image_size=8, width=8, norm="group")
    b = build_model("small_cnn", num_classes=10, in_channels=1, image_size=8, width=8, norm="group")
    b.load_state_dict(a.state_dict())
    a.eval(), b.eval()  # no dropout: recomputation must see the same mask
    assert enable_activation_checkpointing(b) > 0
    assert a.state_dict().keys() == b.state_dict().keys()
    x = torch.randn(4, 1, 8, 8)
    a(x).sum().backward()
    b(x).sum().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, msg=n)
