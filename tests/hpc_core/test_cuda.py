"""The trainer's CUDA paths: fp16 with a GradScaler, bf16, a real out-of-memory, bitwise
repeats, resume, and a GPU checkpoint that a CPU device loads. Upstream trains on GPUs; a
CPU-only host has none of these paths, so there the module is skipped with the reason and
`make test-gpu` runs it on a GPU host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_core.checkpoint import load_model
from hpc_core.trainer import Trainer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device on this host: these are upstream's GPU paths (make test-gpu on a "
    "GPU host runs them)",
)

REPO = Path(__file__).resolve().parents[2]
CNN = ["model.name=small_cnn", "model.kwargs={width: 16, dropout: 0.2}"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cuda_and_the_checkpoint_serves_on_cpu(
    make_config, precision: str
) -> None:
    cfg = make_config(overrides=[*CNN, "training.device=cuda", f"training.precision={precision}",
                                 "training.max_steps=60", "training.global_batch_size=128"])
    t = Trainer(cfg)
    result = t.train()
    assert t.device.type == "cuda"
    assert result.metrics["eval/acc"] > 0.8, result.metrics
    state = json.loads((result.checkpoint_dir / "trainer_state.json").read_text())
    if precision == "fp16":
        # The scaler ran and its scale travels with the checkpoint (a resume must not restart
        # it at 65536 and skip steps again).
        assert t.scaler.is_enabled() and state["scaler"]["scale"] > 0
    else:
        assert not t.scaler.is_enabled()
    # A device without CUDA loads what upstream trained on a GPU: same predictions.
    model, _ = load_model(result.checkpoint_dir, "cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    x, _ = next(iter(t.train_loader))
    t.raw_model.eval()
    with torch.no_grad():
        on_gpu = t.raw_model(x.to("cuda")).float().cpu()
        on_cpu = model.eval()(x)
    assert torch.equal(on_gpu.argmax(1), on_cpu.argmax(1))
    torch.testing.assert_close(on_cpu, on_gpu, atol=1e-3, rtol=1e-3)


def test_a_real_cuda_out_of_memory_halves_the_micro_batch(make_config) -> None:
    # A 64 px CNN at micro-batch 512 needs ~1.5 GB of activations; cap this process's
    # allocator at ~600 MB so that it runs out for real (torch.OutOfMemoryError from the
    # caching allocator, not an injected one) and the trainer retries with smaller halves.
    cfg = make_config(overrides=[
        "model.name=small_cnn", "model.kwargs={width: 32}", "data.image_size=64",
        "training.device=cuda", "training.global_batch_size=512", "training.max_steps=3",
    ])
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(600 * 2**20 / total)
    try:
        t = Trainer(cfg)
        result = t.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert result.final_step == 3 and result.stopped_reason == "completed"
    assert t.state.micro_batch_size < 512, t.state
    assert 512 % t.state.micro_batch_size == 0


def _train(out: Path, sets: list[str], env: dict[str, str], resume: bool = False) -> dict:
    cmd = [sys.executable, "-m", "hpc_core.train", "--config", str(REPO / "configs/digits.yaml")]
    for s in [f"run.output_dir={out}", *sets]:
        cmd += ["--set", s]
    if resume:
        cmd += ["--resume", "auto"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_deterministic_runs_repeat_and_resume_bit_for_bit_on_cuda(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``run.deterministic`` on CUDA: two runs are equal bit for bit, and so is a run preempted
    (SIGTERM) and resumed — BatchNorm, dropout (the CUDA RNG) and SGD momentum included."""
    sets = [
        *CNN, "run.deterministic=true", "training.device=cuda", "training.precision=fp16",
        "optimizer.name=sgd", "optimizer.lr=0.05", "training.max_steps=20",
        "training.eval_every_steps=10", "logging.progress=off",
    ]
    env = {k: v for k, v in subprocess_env.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    a = _train(tmp_path / "a", sets, env)
    _train(tmp_path / "b", sets, env)
    cut = _train(tmp_path / "cut", sets, {**env, "HPC_FAULT_SIGTERM_STEP": "7"})
    assert cut["stopped"] == "SIGTERM" and cut["step"] == 7, cut
    _train(tmp_path / "cut", sets, env, resume=True)
    for name in ("model.safetensors", "optimizer.safetensors"):
        ref = load_file(str(tmp_path / "a/checkpoints/final" / name))
        for other in ("b", "cut"):
            got = load_file(str(tmp_path / other / "checkpoints/final" / name))
            assert ref.keys() == got.keys()
            diff = [k for k in ref if not torch.equal(ref[k], got[k])]
            assert not diff, f"{other}: {name} differs in {diff}"
    assert a["step"] == 20


_TRAIN_AND_REPORT_PEAK = """
import sys, torch
from hpc_core.config import load_config
from hpc_core.trainer import Trainer

Trainer(load_config(sys.argv[1], sys.argv[2:])).train()
print(torch.cuda.max_memory_allocated() / 2**20)
"""


def test_batch_find_on_cuda_bounds_a_real_run_by_the_allocator(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    from hpc_core.batch_find import find_batch_size, probe
    from hpc_core.config import load_config

    sets = [*CNN, "data.image_size=32", "training.device=cuda"]
    cfg = load_config(REPO / "configs/digits.yaml", [f"run.output_dir={tmp_path}", *sets])
    small, large = probe(cfg, 64, None).peak_mb, probe(cfg, 1024, None).peak_mb
    assert small is not None and large is not None and large > small * 2, (small, large)
    limit = (small + large) / 2 / 0.9  # the probe limit (10 % headroom) half way between
    found = find_batch_size(cfg, limit_mb=limit, start=64, max_batch=1024, multiple_of=64)
    assert found.measure == "cuda_max_allocated"
    assert 64 <= found.batch_size < 1024 and found.limited_by == "memory", found
    # The claim: a whole training at that batch, in a fresh process, stays within the limit.
    run = subprocess.run(
        [sys.executable, "-c", _TRAIN_AND_REPORT_PEAK, str(REPO / "configs/digits.yaml"), *sets,
         f"training.global_batch_size={found.batch_size}", "training.epochs=2",
         "logging.progress=off", f"run.output_dir={tmp_path / 'train'}"],
        env=subprocess_env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    peak = float(run.stdout.strip().splitlines()[-1])
    assert peak <= limit, (found.batch_size, peak, limit, found.probes)
