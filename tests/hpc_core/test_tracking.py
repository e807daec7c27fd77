"""Tracking: the same metric names in metrics.jsonl, MLflow (local SQLite store) and TensorBoard."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hpc_core.metrics import read_metrics
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
