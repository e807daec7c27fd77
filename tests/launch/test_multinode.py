"""Two torchrun agents, one per "node", meeting at one c10d rendezvous on loopback.

The same job torchrun would run on two machines (``--nnodes 2 --node-rank 0|1``), with both
agents on this host: two rendezvous participants, a TCP store hosted by one of them, gloo
between two worker processes. The result must equal one process at the same global batch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.ddp import train_argv
from tests.support.mosquitto import free_port as _free_port


def test_two_nodes_on_loopback_equal_one_process(tmp_path: Path, subprocess_env) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    port = _free_port()
    agents = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "loopback-job",
                "--node-rank",
                str(rank),
                "--local-addr",
                "127.0.0.1",
                "--max-restarts",
                "0",
                *train_argv([], tmp_path / "multi"),
            ],
            env=subprocess_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for a, (stdout, stderr) in zip(agents, outs, strict=True):
        assert a.returncode == 0, stdout[-2000:] + stderr[-4000:]
    single = subprocess.run(
        train_argv([sys.executable], tmp_path / "single"),
        env=subprocess_env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-4000:]

    state = json.loads((tmp_path / "multi/checkpoints/final/trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 5
    # Exactly one of the two agents hosted global rank 0, which alone prints the result line.
    results = [line for stdout, _ in outs for line in stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1
    a = load_file(str(tmp_path / "multi/checkpoints/final/model.safetensors"))
    b = load_file(str(tmp_path / "single/checkpoints/final/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)
