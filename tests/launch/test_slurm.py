"""scripts/slurm/train.sbatch on a real single-node Slurm: a job completes; a preempted job
requeues itself and resumes from its checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hpc_core.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts/slurm/train.sbatch"
VENV_BIN = Path(sys.executable).parent

SETS = [
    "model.kwargs={width: 8, norm: none}",
    "data.image_size=8",
    "logging.progress=off",
    "logging.log_every_steps=1",
]


def _submit(cluster: Any, out: Path, max_steps: int, extra: Sequence[str] = ()) -> str:
    # The script's defaults are for GPU nodes: one CPU worker here. The log is appended across
    # requeues by the script's own --open-mode. No RDZV_PORT: a one-node job rendezvouses on
    # a port the kernel picks (a port picked here could be taken by another test meanwhile).
    env = f"ALL,NPROC_PER_NODE=1,OMP_NUM_THREADS=1,OUTPUT_DIR={out}"
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1"]
    cmd += [f"--output={cluster.root}/jobs/%j.out", f"--chdir={REPO}"]
    cmd += [f"--export={env}", str(SBATCH), "configs/digits.yaml"]
    for s in [*SETS, f"training.max_steps={max_steps}", *extra]:
        cmd += ["--set", s]
    path = f"{VENV_BIN}:{cluster.env['PATH']}"
    p = subprocess.run(cmd, env={**cluster.env, "PATH": path}, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def _log(cluster: Any, job_id: str) -> str:
    path = cluster.root / "jobs" / f"{job_id}.out"
    return path.read_text() if path.exists() else "(no job output)"


def _requeued_report(cluster: Any, job_id: str, offset: int, since: str) -> str:
    """What a failed restart left behind: the requeued run's own output (the log from where
    the first run's ended), Slurm's view of the job, and both daemons' logs since the
    preemption (a run that never launched writes no output, only a daemon says why)."""
    log = _log(cluster, job_id)
    # Without the per-step metric lines (one a step): what is left is what went wrong.
    second = "\n".join(ln for ln in log[offset:].splitlines() if not ln.startswith('{"step"'))
    info = cluster.job(job_id)
    fields = " ".join(f"{k}={info.get(k)}" for k in ("JobState", "Reason", "ExitCode", "Restarts"))
    return (
        f"requeued run's output:\n{second[-4000:] or '(none)'}\n\nscontrol: {fields}\n\n"
        f"slurmctld.log since {since}:\n{cluster.log_since('slurmctld', since)}\n\n"
        f"slurmd.log since {since}:\n{cluster.log_since('slurmd', since)}\n\n"
        f"first run's output (tail):\n{log[:offset][-1500:]}"
    )


def test_sbatch_job_completes_with_a_checkpoint(slurm_cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = _submit(slurm_cluster, out, max_steps=30)
    info = slurm_cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 180)
    assert info["JobState"] == "COMPLETED", _log(slurm_cluster, job)[-3000:]
    state = json.loads((out / "checkpoints/final/trainer_state.json").read_text())
    assert state["step"] == 30 and state["world_size"] == 1
    assert (out / "checkpoints/final/COMPLETE").exists()


@pytest.mark.slow
def test_preempted_job_requeues_and_resumes(slurm_cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    total = 600
    # Evaluate only at the end and keep no best checkpoint: the only step checkpoint is the
    # one the SIGTERM makes, so a resume from anywhere else shows.
    extra = [f"training.eval_every_steps={total}", "checkpoint.best_metric=null"]
    job = _submit(slurm_cluster, out, max_steps=total, extra=extra)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and any(r.get("step", 0) >= 20 for r in read_metrics(metrics))):
        assert time.monotonic() < deadline, _log(slurm_cluster, job)[-3000:]
        assert slurm_cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), _log(
            slurm_cluster, job
        )
        time.sleep(0.2)
    # What Slurm does before a preemption or the time limit: SIGTERM to the batch shell.
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    slurm_cluster.run("scancel", "--batch", "--signal=TERM", job)
    info = slurm_cluster.wait_state(job, {"PENDING"}, 120)
    assert int(info["Restarts"]) == 1
    first_run_bytes = len(_log(slurm_cluster, job))
    # Slurm holds a requeued job back for a while (BeginTime); start it as soon as it is safe.
    slurm_cluster.release_requeued(job, timeout_s=120)
    info = slurm_cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 240)
    log = _log(slurm_cluster, job)
    assert info["JobState"] == "COMPLETED", _requeued_report(
        slurm_cluster, job, first_run_bytes, since
    )
    state = json.loads((out / "checkpoints/final/trainer_state.json").read_text())
    assert state["step"] == total
    # The first run checkpointed at the step it stopped; the second resumed from exactly there.
    stopped = re.search(r"stopped \(SIGTERM\) at step (\d+)", log)
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert stopped and resumed and "preempted: forwarding SIGTERM" in log, log[-4000:]
    assert 20 <= int(stopped[1]) == int(resumed[1]) < total
    # Every step was trained once: none repeated after the restart, none skipped.
    steps = [r["step"] for r in read_metrics(metrics) if "train/loss" in r]
    assert steps == list(range(1, total + 1))
