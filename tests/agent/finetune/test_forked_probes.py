"""The memory plan's forked probes (``agent.finetune.memory_probes --forked``): one fresh process
starts up as a probe does, then forks a child per micro-batch size. They must measure what a
fresh probe measures, name the size whose child failed, and never fork where forking is unsafe."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.finetune import memory_probes
from agent.finetune.memory_probes import Probe, probe_config, probe_forked, probe_subprocess
from hpc_core.config import TrainConfig, load_config
from hpc_core.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, Path]:
    """A digits small_cnn checkpoint (two real steps) and the fine-tune config that probes it."""
    root = tmp_path_factory.mktemp("forked")
    sets = ["data.image_size=16", "logging.progress=off", "model.kwargs={width: 16}"]
    Trainer(load_config(REPO / "configs/digits.yaml",
                        [f"run.output_dir={root / 'up'}", "training.max_steps=2", *sets])).train()
    cfg = load_config(REPO / "configs/digits.yaml",
                      [f"run.output_dir={root / 'job'}", "training.global_batch_size=16", *sets])
    return cfg, root / "up" / "checkpoints" / "final"


def test_forked_probes_measure_what_a_fresh_probe_does(
    job: tuple[TrainConfig, Path], caplog: pytest.LogCaptureFixture
) -> None:
    cfg, start = job
    with caplog.at_level(logging.DEBUG, logger="agent.finetune.memory_probes"):
        forked = probe_forked(cfg, start, "all", [4, 16])
    assert forked is not None and sorted(forked) == [4, 16]
    fresh = probe_subprocess(cfg, start, "all", 16)
    # Fresh probes of one size differ by a few MB between processes; a forked child that
    # missed the start-up's pages (or counted the server's twice) would be tens of MB off.
    assert abs(forked[16].step_mb - fresh.step_mb) <= 12.0, (forked, fresh)
    assert abs(forked[16].startup_mb - fresh.startup_mb) <= 12.0, (forked, fresh)
    assert forked[4].step_mb <= forked[16].step_mb + 3.0, forked
    # One start-up, one child per size: each answer came from its own child of the server.
    answers = [re.search(r"micro-batch (\d+): child (\d+) of server (\d+)", r.getMessage())
               for r in caplog.records]
    found = [(int(a[1]), int(a[2]), int(a[3])) for a in answers if a]
    assert [m for m, _, _ in found] == [4, 16], caplog.text
    children, servers = {c for _, c, _ in found}, {s for _, _, s in found}
    assert len(children) == 2 and len(servers) == 1 and not children & servers, found


def test_a_failing_child_is_named_by_its_size(job: tuple[TrainConfig, Path]) -> None:
    cfg, start = job
    broken = cfg.model_copy(update={
        "data": cfg.data.model_copy(update={"source": "npz", "path": Path("/nonexistent.npz")}),
        "run": cfg.run.model_copy(update={"output_dir": cfg.run.output_dir.parent / "broken"})})
    with pytest.raises(RuntimeError, match=r"memory probe at micro-batch 4 failed") as e:
        probe_forked(broken, start, "all", [4, 16])
    assert "nonexistent.npz" in str(e.value)  # the child's own error, from the server's stderr


def test_a_probe_on_cuda_is_never_forked(job: tuple[TrainConfig, Path]) -> None:
    """The server refuses (before it starts up) where a size trains on CUDA; the planner then
    probes each size fresh. A CPU host can still check the refusal."""
    cfg, start = job
    cuda = cfg.model_copy(update={
        "training": cfg.training.model_copy(update={"device": "cuda"}),
        "run": cfg.run.model_copy(update={"output_dir": cfg.run.output_dir.parent / "cuda"})})
    assert probe_forked(cuda, start, "all", [4, 16]) is None  # refused: the planner goes fresh
    spec = cuda.run.output_dir / "probes" / "forked.json"
    p = subprocess.run([sys.executable, "-m", "agent.finetune.memory_probes", "--forked",
                        str(spec)], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == memory_probes.FORK_UNSAFE, p.stderr[-2000:]
    assert "micro-batch 4 trains on CUDA" in p.stderr and p.stdout == ""


def test_fork_is_refused_beside_a_running_thread() -> None:
    code = ("import threading, time; from agent.finetune.memory_probes import fork_blocker; "
            "print(fork_blocker()); t = threading.Thread(target=time.sleep, args=(5,), "
            "daemon=True); t.start(); print(fork_blocker())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    alone, beside = p.stdout.splitlines()
    assert alone == "None"
    assert beside == "2 threads are running in the probe process"


def test_a_thread_list_it_cannot_hand_a_child_probes_each_size_fresh(
    job: tuple[TrainConfig, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OMP_NUM_THREADS as a nested list ("4,2"): the server starts with one thread and gives
    each child the job's count, which a list is not; each size gets a fresh process."""
    cfg, start = job
    fresh: list[int] = []
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    monkeypatch.setattr(memory_probes, "probe_subprocess",
                        lambda cfg, init, trainable, m: fresh.append(m) or Probe(1.0, 1.0))
    assert probe_forked(cfg, start, "all", [4, 16]) is None
    assert memory_probes.run_probes(cfg, start, "all", [4, 16], fork=True) == {
        4: Probe(1.0, 1.0), 16: Probe(1.0, 1.0)}
    assert fresh == [4, 16]


def test_a_probe_at_the_whole_effective_batch_steps_on_no_more_than_the_job(
    job: tuple[TrainConfig, Path]
) -> None:
    """A job whose micro-batch is its whole effective batch, past half the data (digits: 1,797
    samples, 1,707 of them trained on beside a 5 % held-out share): its probe steps on one
    micro-batch, as the job does. Two of them asked for 2,200 samples and failed, which left a
    forced micro-batch unchecked (the job then ran 90 MB past its budget)."""
    cfg, start = job
    whole = cfg.model_copy(update={
        "training": cfg.training.model_copy(update={"global_batch_size": 1100}),
        "data": cfg.data.model_copy(update={"val_fraction": 0.05}),
        "run": cfg.run.model_copy(update={"output_dir": cfg.run.output_dir.parent / "whole"})})
    assert probe_config(whole, Path("-"), 1100).training.global_batch_size == 1100
    assert probe_config(whole, Path("-"), 300).training.global_batch_size == 600  # accumulates
    assert probe_config(whole, Path("-"), 700).training.global_batch_size == 1100  # 700 + 400
    found = probe_subprocess(whole, start, "all", 1100)
    assert found.step_mb > 0 and found.startup_mb > 0, found
