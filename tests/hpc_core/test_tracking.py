"""Tracking: the same metric names in metrics.jsonl, MLflow (local SQLite store), TensorBoard and
W&B (offline); every run ends with how it ended: FINISHED, FAILED or KILLED."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpc_core.faults import FaultInjector
from hpc_core.metrics import read_metrics
from hpc_core.tracking import MlflowSink
from hpc_core.trainer import Trainer

mlflow = pytest.importorskip("mlflow")


def test_mlflow_and_tensorboard_get_params_metrics_and_artefacts(make_config) -> None:
    cfg = make_config(
        "run",
        [
            "training.max_steps=12",
            "training.eval_every_steps=4",
            "logging.log_every_steps=2",
            "logging.mlflow=true",
            "logging.tensorboard=true",
        ],
    )
    out = cfg.run.output_dir
    trainer = Trainer(cfg)
    trainer.train()
    records = read_metrics(out / "metrics.jsonl")
    names = {k for r in records for k in r if k not in ("step", "time", "event")}
    for expected in (
        "train/loss",
        "eval/acc",
        "lr",
        "samples_per_s",
        "sys/cpu_percent",
        "sys/rss_mb",
    ):
        assert expected in names, names

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out.resolve()}/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name == "edgetrain"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "test"
    assert run.data.params["optimizer.lr"] == "0.003"
    assert run.data.params["model.name"] == "mlp"
    assert names <= set(run.data.metrics), names - set(run.data.metrics)  # same names
    history = client.get_metric_history(run.info.run_id, "eval/acc")
    assert [m.step for m in history] == [4, 8, 12]
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"checkpoint_manifest.json", "metrics.jsonl", "plots", "checkpoint"} <= top
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/curves.png"]
    local = Path(client.download_artifacts(run.info.run_id, "checkpoint_manifest.json", str(out)))
    manifest = json.loads(local.read_text())
    assert manifest["step"] == 12 and manifest["config_digest"] == trainer.cfg.digest()
    model = next(f for f in manifest["files"] if f["name"] == "model.safetensors")
    blob = (out / "checkpoints/final/model.safetensors").read_bytes()
    assert model["sha256"] == hashlib.sha256(blob).hexdigest() and model["bytes"] == len(blob)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert names == set(acc.Tags()["scalars"])


def _mlflow(out: Path) -> mlflow.tracking.MlflowClient:
    return mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out.resolve()}/mlflow.db")


def _mlflow_runs(out: Path) -> list:
    client = _mlflow(out)
    (exp,) = [e for e in client.search_experiments() if e.name == "edgetrain"]
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


class _DiskFull:
    """A hook that fails the run after step 3, as a full disk or a lost mount would."""

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if step == 3:
            raise OSError(28, "No space left on device")


def test_a_failed_run_ends_failed_and_an_interrupted_one_killed(make_config) -> None:
    sets = ["training.max_steps=8", "logging.mlflow=true"]
    cfg = make_config("failed", sets)
    with pytest.raises(OSError, match="No space left"):
        Trainer(cfg, hooks=[_DiskFull()]).train()
    out = cfg.run.output_dir
    (run,) = _mlflow_runs(out)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "OSError after step 3: [Errno 28] No space left on device"
    # What it logged up to the failure is there, metrics and artefacts.
    history = _mlflow(out).get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3]
    artefacts = {a.path for a in _mlflow(out).list_artifacts(run.info.run_id)}
    assert {"metrics.jsonl", "plots"} <= artefacts
    assert not (out / MlflowSink.OPEN_RUN).exists()

    cfg = make_config("preempted", sets)
    result = Trainer(cfg, faults=FaultInjector(sigterm_step=4)).train()
    assert result.stopped_reason == "SIGTERM" and result.final_step == 4
    (run,) = _mlflow_runs(cfg.run.output_dir)
    assert run.info.status == "KILLED" and "error" not in run.data.tags


def test_a_run_killed_mid_training_is_marked_failed(make_config, subprocess_env) -> None:
    cfg = make_config(
        "killed", ["training.max_steps=100000", "logging.mlflow=true", "checkpoint.every_steps=5"]
    )
    out = cfg.run.output_dir
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpc_core.train", "--config", str(out / "config.yaml")],
        env=subprocess_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        # Mid-training: a few steps logged and checkpointed, far from the end. Any step
        # checkpoint past 10: with keep_last=2 a fast run has pruned step 10 before a poll.
        def past_step_10() -> bool:
            steps = (p.name.removeprefix("step_") for p in (out / "checkpoints").glob("step_*"))
            return any(s.isdigit() and int(s) >= 10 for s in steps)

        while not past_step_10():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # no handler, no finally: the run is left RUNNING
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (run,) = _mlflow_runs(out)
    assert run.info.status == "RUNNING"
    # The next start in the folder (here the resume of the job) marks it FAILED.
    resumed = cfg.model_copy(deep=True)
    resumed.training.max_steps = 20
    Trainer(resumed).train(resume="auto")
    killed, second = _mlflow_runs(out)
    assert killed.info.run_id == run.info.run_id and killed.info.status == "FAILED"
    assert killed.data.tags["error"].startswith("the process died without closing the run")
    assert second.info.status == "FINISHED"


def _same_param(text: str, value: object) -> bool:
    """An MLflow param (its str()) and a W&B config value are the same value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(text) == value
    if isinstance(value, list):
        return yaml.safe_load(text) == value
    return str(value) == text


def _inspect(run_dir: Path, *flags: str) -> str:
    """W&B's own reader of an offline run's transaction log (run-*.wandb)."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", *flags, str(run_dir)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return out.stdout


def test_wandb_offline_run_has_what_mlflow_has(make_config, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))  # nothing written to $HOME
    cfg = make_config(
        "run",
        [
            "training.max_steps=12",
            "training.eval_every_steps=4",
            "logging.log_every_steps=2",
            "logging.mlflow=true",
            "logging.wandb={project: edgetrain-test}",
        ],
    )
    out = cfg.run.output_dir
    assert cfg.logging.wandb is not None and cfg.logging.wandb.mode == "offline"
    Trainer(cfg).train()
    (run_dir,) = (out / "wandb").glob("offline-run-*")

    summary = json.loads(_inspect(run_dir, "--summary", "--json"))
    assert summary["state"] == "finished" and summary["name"] == "test"
    assert summary["project"] == "edgetrain-test" and summary["summary"]["status"] == "FINISHED"
    records = [json.loads(line) for line in _inspect(run_dir, "--json").splitlines()]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    saved = {f["path"] for r in records if r["type"] == "files" for f in r["files"]["files"]}

    (mrun,) = _mlflow_runs(out)
    client = _mlflow(out)
    # Params: the same flattened config. MLflow keeps each as a string, W&B as a value (that
    # its reader prints 0.0 as 0): compare values.
    assert set(summary["config"]) == set(mrun.data.params)
    for key, value in summary["config"].items():
        assert _same_param(mrun.data.params[key], value), key
    # Metrics: the same names, and the same values at the same steps.
    names = {k for item in history for k in item if not k.startswith("_") and k != "step"}
    assert names == set(mrun.data.metrics)
    acc = [(item["step"], item["eval/acc"]) for item in history if "eval/acc" in item]
    mlflow_acc = client.get_metric_history(mrun.info.run_id, "eval/acc")
    assert acc == [(m.step, pytest.approx(m.value)) for m in mlflow_acc]
    assert [s for s, _ in acc] == [4, 8, 12]
    # Artefacts: the same files, byte for byte.
    artefacts = {
        "metrics.jsonl", "plots/curves.png", "checkpoint_manifest.json",
        "checkpoint/trainer_state.json",
    }  # fmt: skip
    assert artefacts <= saved, saved
    local = Path(client.download_artifacts(mrun.info.run_id, "", str(tmp_path / "mlflow")))
    for name in artefacts:
        assert (run_dir / "files" / name).read_bytes() == (local / name).read_bytes(), name


def test_wandb_records_a_failed_run(make_config, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    cfg = make_config("failed", ["training.max_steps=8", "logging.wandb={}"])
    with pytest.raises(OSError):
        Trainer(cfg, hooks=[_DiskFull()]).train()
    (run_dir,) = (cfg.run.output_dir / "wandb").glob("offline-run-*")
    summary = json.loads(_inspect(run_dir, "--summary", "--json"))
    assert summary["state"] == "failed" and summary["summary"]["status"] == "FAILED"
    assert summary["summary"]["error"].startswith("OSError after step 3")
