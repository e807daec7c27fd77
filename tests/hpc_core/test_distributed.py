"""DDP through torchrun (gloo, CPU) against one process at the same global batch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.ddp import train_argv as _cmd


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun is not installed next to this Python")
    return [exe, "--standalone", "--nproc-per-node", "2"]


def test_ddp_two_ranks_equals_one_process(tmp_path: Path, subprocess_env) -> None:
    _run(_cmd([sys.executable], tmp_path / "single", []), subprocess_env)
    p = _run(_cmd(_torchrun(), tmp_path / "ddp", []), subprocess_env)
    single = load_file(str(tmp_path / "single/checkpoints/final/model.safetensors"))
    ddp = load_file(str(tmp_path / "ddp/checkpoints/final/model.safetensors"))
    assert single.keys() == ddp.keys()
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], atol=1e-6, rtol=1e-6)
    # Rank 0 alone reports and writes: one result line, one metrics stream, world size 2 saved.
    results = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1
    state = json.loads((tmp_path / "ddp/checkpoints/final/trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 5
    # Sharded evaluation over both ranks counts every validation sample once.
    single_eval = json.loads(
        (tmp_path / "single/checkpoints/final/trainer_state.json").read_text()
    )["metrics"]
    assert state["metrics"]["eval/acc"] == pytest.approx(single_eval["eval/acc"], abs=1e-9)


def test_ddp_with_accumulation_and_preemption(tmp_path: Path, subprocess_env) -> None:
    """Both ranks agree to stop on SIGTERM at the same step, and resume from that checkpoint."""
    env = {**subprocess_env, "HPC_FAULT_SIGTERM_STEP": "2"}
    extra = ["training.micro_batch_size=8"]
    p = _run(_cmd(_torchrun(), tmp_path / "ddp", extra), env)
    assert json.loads(p.stdout.strip().splitlines()[-1])["stopped"] == "SIGTERM"
    p = _run([*_cmd(_torchrun(), tmp_path / "ddp", extra), "--resume", "auto"], subprocess_env)
    assert json.loads(p.stdout.strip().splitlines()[-1])["step"] == 5
    _run(_cmd([sys.executable], tmp_path / "single", []), subprocess_env)
    single = load_file(str(tmp_path / "single/checkpoints/final/model.safetensors"))
    ddp = load_file(str(tmp_path / "ddp/checkpoints/final/model.safetensors"))
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], atol=1e-5, rtol=1e-4)


def test_a_torchrun_rank_ends_with_its_code_and_its_output_flushed(subprocess_env) -> None:
    # end_rank skips interpreter finalization under torchrun (gloo's threads may still be
    # freeing the last collective's tensors), so it must flush what the rank printed and
    # logged itself and keep the exit code; in one process it only returns the code.
    code = (
        "import logging, sys\n"
        "from hpc_core.distributed import end_rank\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "if sys.argv[1] == '1':\n"
        "    assert end_rank(5) == 5\n"
        "sys.stdout.write('result line')\n"
        "logging.getLogger('x').warning('last log line')\n"
        "end_rank(3)\n"
        "sys.exit(4)\n"
    )
    for world, want in (("2", 3), ("1", 4)):
        p = subprocess.run([sys.executable, "-c", code, world], capture_output=True, text=True,
                           env={**subprocess_env, "WORLD_SIZE": world}, timeout=120)
        assert p.returncode == want, p.stderr
        assert p.stdout == "result line" and "last log line" in p.stderr
