"""Equivalence and fault tests for the training loop, on real digits data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_core import checkpoint as ckpt
from hpc_core.config import load_config
from hpc_core.data import TensorImageDataset, build_datasets
from hpc_core.faults import FaultInjector
from hpc_core.metrics import read_metrics
from hpc_core.trainer import Trainer, TrainingDiverged, lr_factor

REPO = Path(__file__).resolve().parents[2]


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}


def assert_close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, rtol: float
) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def test_micro_batches_accumulate_to_the_full_batch(make_config) -> None:
    # fp32, no BatchNorm: 4 micro-batches of 16 must give the same update as one batch of 64.
    full = Trainer(make_config("full"))
    full.train()
    micro = Trainer(make_config("micro", ["training.micro_batch_size=16"]))
    assert micro.state.micro_batch_size == 16
    micro.train()
    assert_close(params(micro), params(full), atol=1e-5, rtol=1e-4)
    # ... and it really trained: the weights moved from their initial values.
    init = Trainer(make_config("init"))
    assert not torch.allclose(params(init)["1.weight"], params(full)["1.weight"])


def test_injected_oom_halves_the_micro_batch_and_keeps_the_result(make_config) -> None:
    ref = Trainer(make_config("ref"))
    ref.train()
    # From step 3 on, any micro-batch above 16 samples "runs out of memory".
    t = Trainer(make_config("oom"), faults=FaultInjector(oom_step=3, oom_above=16))
    result = t.train()
    assert result.stopped_reason == "completed" and result.final_step == 5
    assert t.state.micro_batch_size == 16
    assert_close(params(t), params(ref), atol=1e-5, rtol=1e-4)
    events = [
        m for m in read_metrics(t.cfg.run.output_dir / "metrics.jsonl") if m.get("event") == "oom"
    ]
    assert [(e["step"], e["micro_batch_from"], e["micro_batch_to"]) for e in events] == [
        (3, 64, 32),
        (3, 32, 16),
    ]


def test_oom_below_the_floor_stops_with_the_step(make_config) -> None:
    t = Trainer(
        make_config(overrides=["faults.min_micro_batch_size=32"]),
        faults=FaultInjector(oom_step=2, oom_above=8),
    )
    with pytest.raises(RuntimeError, match="out of memory at step 2 with micro-batch 32"):
        t.train()


def test_injected_nan_rolls_back_and_scales_the_lr(make_config) -> None:
    cfg = make_config(overrides=["training.max_steps=10", "checkpoint.every_steps=4"])
    t = Trainer(cfg, faults=FaultInjector(nan_step=7))
    result = t.train()
    assert result.final_step == 10 and result.stopped_reason == "completed"
    assert t.state.nan_rollbacks == 1
    assert t.state.lr_scale == pytest.approx(0.1)
    lines = read_metrics(cfg.run.output_dir / "metrics.jsonl")
    [event] = [m for m in lines if m.get("event") == "rollback"]
    assert event["step"] == 7 and event["restored_step"] == 4
    # Steps 5-7 ran again at a tenth of the learning rate.
    lrs = {m["step"]: m["lr"] for m in lines if "lr" in m}
    assert lrs[5] == pytest.approx(0.1 * 0.003 * lr_factor(4, 10, cfg.schedule))
    assert all(torch.isfinite(p).all() for p in params(t).values())


def test_nan_before_any_checkpoint_restores_the_initial_state(make_config) -> None:
    t = Trainer(make_config(), faults=FaultInjector(nan_step=2))
    assert t.train().final_step == 5
    assert t.state.nan_rollbacks == 1


def test_persistent_nan_gives_up_after_three_rollbacks_naming_the_step(make_config) -> None:
    train, val, _ = build_datasets(make_config().data)
    x = train.x.clone()
    x[:] = float("nan")
    t = Trainer(make_config(), datasets=(TensorImageDataset(x, train.y), val))
    with pytest.raises(TrainingDiverged, match=r"non-finite loss at step 1 after 3 rollback\(s\)"):
        t.train()


def test_digits_config_reaches_97_percent(tmp_path: Path) -> None:
    cfg = load_config(
        REPO / "configs/digits.yaml", [f"run.output_dir={tmp_path}", "logging.progress=off"]
    )
    result = Trainer(cfg).train()
    assert result.stopped_reason == "completed"
    assert result.metrics["eval/acc"] >= 0.97, result.metrics
    # Metrics landed in metrics.jsonl with the keys people plot.
    keys = set().union(*(m.keys() for m in read_metrics(tmp_path / "metrics.jsonl")))
    assert {"train/loss", "eval/loss", "eval/acc", "lr", "samples_per_s", "mem/peak_rss_mb"} <= keys
    # The resolved config saved in the checkpoint rebuilds the same model.
    model, saved_cfg = ckpt.load_model(result.checkpoint_dir)
    assert saved_cfg.model.num_classes == 10 and saved_cfg.model.image_size == 16
    trainer_weights = load_file(str(result.checkpoint_dir / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trainer_weights.items())
    _, val, _ = build_datasets(saved_cfg.data)
    model.eval()
    with torch.no_grad():
        acc = (model(val.x).argmax(1) == val.y).float().mean().item()
    assert acc == pytest.approx(result.metrics["eval/acc"], abs=1e-6)
    # Best and final checkpoints exist; older step checkpoints were pruned to keep_last.
    root = tmp_path / "checkpoints"
    assert ckpt.best_target(root) is not None
    assert len(ckpt.list_step_checkpoints(root)) <= cfg.checkpoint.keep_last + 1


def test_early_stopping(make_config) -> None:
    cfg = make_config(
        overrides=[
            "training.max_steps=200",
            "training.eval_every_steps=2",
            "training.early_stopping.patience=2",
            "training.early_stopping.metric=eval/loss",
            "training.early_stopping.mode=min",
            "training.early_stopping.min_delta=10.0",
        ]
    )
    result = Trainer(cfg).train()
    # Nothing improves eval/loss by 10, so it stops after the first eval plus 2 patience evals.
    assert result.stopped_reason == "early_stopping" and result.final_step == 6


def test_request_stop_from_a_hook_checkpoints(make_config) -> None:
    class StopAt3:
        def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
            assert metrics["train/loss"] > 0
            if step == 3:
                trainer.request_stop("too hot")

    t = Trainer(make_config(), hooks=[StopAt3()])
    result = t.train()
    assert result.stopped_reason == "requested: too hot" and result.final_step == 3
    assert result.checkpoint_dir == ckpt.step_dir(t.ckpt_root, 3)


def test_channels_last_trains_as_nchw_does_and_resumes_bit_for_bit(make_config) -> None:
    # SGD: an update linear in the gradient, so float rounding stays rounding (AdamW turns a
    # tiny gradient's rounding into a whole step of either sign)
    cnn = ["model.name=small_cnn", "model.kwargs={width: 8}", "data.image_size=16",
           "optimizer.name=sgd", "optimizer.lr=0.05", "training.max_steps=6",
           "training.device=cpu"]
    plain = Trainer(make_config("plain", cnn))
    plain.train()
    nhwc = Trainer(make_config("nhwc", [*cnn, "training.channels_last=true"]))
    convs = [m.weight for m in nhwc.raw_model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert any(not w.is_contiguous() for w in convs)  # (one input channel: the same order)
    nhwc.train()
    # other convolution kernels, the same training to float rounding
    assert_close(params(nhwc), params(plain), atol=1e-4, rtol=1e-3)
    # checkpoints hold the usual order, which a plain model loads
    saved = load_file(str(nhwc.ckpt_root / "final" / "model.safetensors"))
    assert all(t.is_contiguous() for t in saved.values())
    fresh = Trainer(make_config("fresh", cnn))
    fresh.raw_model.load_state_dict(saved)
    assert_close(params(fresh), params(nhwc), atol=0, rtol=0)

    class StopAt2:
        def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
            if step == 2:
                trainer.request_stop("preempted")

    cut = make_config("cut", [*cnn, "training.channels_last=true"])
    Trainer(cut, hooks=[StopAt2()]).train()
    resumed = Trainer(cut)
    resumed.train(resume="auto")
    assert resumed.state.step == 6
    assert_close(params(resumed), params(nhwc), atol=0, rtol=0)


def test_frozen_batchnorm_stays_in_eval_mode(make_config) -> None:
    cfg = make_config(model={"name": "small_cnn", "kwargs": {"width": 8}})
    t = Trainer(cfg)
    for p in t.raw_model.features.parameters():
        p.requires_grad_(False)
    t = Trainer(cfg, model=t.raw_model)
    bn = t.raw_model.features[0][1]
    before = bn.running_mean.clone()
    t.train()
    assert not bn.training
    assert torch.equal(bn.running_mean, before)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(make_config, precision: str) -> None:
    t = Trainer(make_config(overrides=[f"training.precision={precision}", "training.max_steps=20"]))
    result = t.train()
    assert result.metrics["eval/acc"] > 0.5
    if precision == "fp16":
        assert t.scaler.is_enabled()


def test_lr_schedule_warmup_then_cosine(make_config) -> None:
    s = make_config(overrides=["schedule.warmup_steps=10", "schedule.min_lr_ratio=0.1"]).schedule
    assert lr_factor(0, 100, s) == pytest.approx(0.1)
    assert lr_factor(9, 100, s) == pytest.approx(1.0)
    assert lr_factor(55, 100, s) == pytest.approx(0.55, abs=0.01)
    assert lr_factor(100, 100, s) == pytest.approx(0.1)


def test_sigterm_then_resume_is_bitwise_identical(
    tmp_path: Path, python: str, subprocess_env
) -> None:
    """A run preempted at a random step and resumed equals the uninterrupted run bit for bit
    (on CPU; CUDA's kernels repeat bit for bit only with run.deterministic: test_cuda.py)."""
    import random
    import subprocess

    # BatchNorm + dropout + SGD momentum: every piece of state a resume must carry.
    sets = [
        "training.device=cpu",
        "model.name=small_cnn",
        "model.kwargs={width: 8, dropout: 0.3}",
        "optimizer.name=sgd",
        "optimizer.lr=0.05",
        "training.max_steps=30",
        "training.eval_every_steps=10",
        "schedule.warmup_steps=5",
        "logging.progress=off",
        "data.val_fraction=0.5",
    ]

    def run(out: Path, extra_env: dict[str, str] | None = None, resume: bool = False) -> dict:
        cmd = [
            python,
            "-m",
            "hpc_core.train",
            "--config",
            str(REPO / "configs/digits.yaml"),
            "--set",
            f"run.output_dir={out}",
        ]
        for s in sets:
            cmd += ["--set", s]
        if resume:
            cmd += ["--resume", "auto"]
        p = subprocess.run(
            cmd,
            env={**subprocess_env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    stop_at = random.Random().randint(1, 29)
    full = run(tmp_path / "full")
    stopped = run(tmp_path / "cut", {"HPC_FAULT_SIGTERM_STEP": str(stop_at)})
    assert stopped["stopped"] == "SIGTERM" and stopped["step"] == stop_at, stopped
    resumed = run(tmp_path / "cut", resume=True)
    assert resumed["step"] == full["step"] == 30
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = load_file(str(tmp_path / "full/checkpoints/final" / name))
        b = load_file(str(tmp_path / "cut/checkpoints/final" / name))
        assert a.keys() == b.keys()
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        assert not diff, f"stopped at {stop_at}: {name} differs in {diff}"


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a) ** 0.5)


def test_proximal_term_adds_mu_times_the_drift_to_each_gradient(make_config) -> None:
    """FedProx: the gradient of (mu / 2) * ||w - w_start||^2 is mu * (w - w_start), added
    to whatever the data gave."""
    t = Trainer(make_config("prox", ["training.proximal_mu=0.5"]))
    with torch.no_grad():
        for p in t.params:
            p.add_(1.0)
            p.grad = torch.full_like(p, 2.0)
    t._proximal_gradient()
    for p in t.params:
        torch.testing.assert_close(p.grad, torch.full_like(p, 2.0 + 0.5 * 1.0))
    off = Trainer(make_config("noprox"))
    assert off.anchor == []  # off: no copy of the weights is kept


def test_proximal_term_keeps_the_weights_closer_to_where_they_started(make_config) -> None:
    init = params(Trainer(make_config("init")))
    drift = {}
    for mu in (0.0, 1.0, 10.0):
        t = Trainer(make_config(f"mu{mu}", [f"training.proximal_mu={mu}"]))
        t.train()
        drift[mu] = _distance(params(t), init)
    assert drift[10.0] < drift[1.0] < drift[0.0], drift
