"""Experiment tracking sinks beside metrics.jsonl: MLflow, TensorBoard, and system metrics.

Every sink receives the same metric names as metrics.jsonl (``train/loss``, ``eval/acc``,
``sys/rss_mb`` ...). MLflow's embedded default is a SQLite store in the run's folder
(``output_dir/mlflow.db``, artefacts in ``output_dir/mlartifacts``); set
``logging.mlflow_tracking_uri`` to a tracking server's URL (or another database) to share one.
At the end of a run the MLflow sink attaches the final checkpoint's manifest (each file's size
and sha256, step, config digest, metrics), metrics.jsonl and a plot of the curves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


class SystemSampler:
    """CPU use of this process since the last sample, its RSS, and the GPU's use and memory."""

    def __init__(self) -> None:
        # The trainer has already picked this rank's GPU (torch.cuda.set_device) if it uses one.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        self._last = (time.monotonic(), _cpu_seconds())

    def sample(self) -> dict[str, float]:
        now, cpu = time.monotonic(), _cpu_seconds()
        wall = now - self._last[0]
        out = {
            # 100 = one core busy; 2 cores busy read 200 (like top).
            "sys/cpu_percent": 100.0 * (cpu - self._last[1]) / wall if wall > 0 else 0.0,
            "sys/rss_mb": _rss_mb(),
        }
        self._last = (now, cpu)
        if self.device is not None:
            out["sys/gpu_mem_mb"] = torch.cuda.memory_reserved(self.device) / 2**20
            # Utilisation needs pynvml (or amdsmi); memory alone is still worth logging.
            with contextlib.suppress(Exception):
                out["sys/gpu_util_percent"] = float(torch.cuda.utilization(self.device))
        return out


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def checkpoint_manifest(path: Path) -> dict[str, Any]:
    """What a checkpoint folder holds: every file's size and sha256, plus its step and metrics."""
    files = []
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
        files.append({"name": f.name, "bytes": f.stat().st_size, "sha256": h.hexdigest()})
    state = json.loads((path / "trainer_state.json").read_text())
    return {
        "checkpoint": str(path),
        "step": state.get("step"),
        "config_digest": state.get("config_digest"),
        "metrics": state.get("metrics", {}),
        "files": files,
    }


def curves_png(records: list[dict[str, Any]]) -> bytes:
    """Train loss and eval accuracy against step, from metrics.jsonl records."""
    from hpc_core.plots import figure, png_bytes

    fig = figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    for key, axis in (("train/loss", ax), ("eval/acc", ax.twinx())):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if pts:
            axis.plot(*zip(*pts, strict=True), color="C0" if key == "train/loss" else "C1")
            axis.set_ylabel(key)
    ax.set_xlabel("step")
    return png_bytes(fig)


class MlflowSink:
    def __init__(
        self, output_dir: Path, tracking_uri: str | None, run_name: str, params: dict[str, Any]
    ) -> None:
        try:
            import mlflow
        except ImportError as e:
            raise RuntimeError("logging.mlflow=true needs `pip install edgetrain[tracking]`") from e
        self.mlflow = mlflow
        self.output_dir = output_dir
        uri = tracking_uri or f"sqlite:///{output_dir.resolve()}/mlflow.db"
        mlflow.set_tracking_uri(uri)
        name = "edgetrain"
        if mlflow.get_experiment_by_name(name) is None:
            # Local stores keep artefacts beside the database; a server decides for itself.
            location = None
            if tracking_uri is None:
                location = (output_dir.resolve() / "mlartifacts").as_uri()
            try:
                mlflow.create_experiment(name, artifact_location=location)
            except Exception:  # another process created it first: use theirs
                log.debug("experiment %s exists already", name)
        mlflow.set_experiment(name)
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params(params)
        log.info("mlflow run %s in %s", self.run.info.run_id, uri)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self, records: list[dict[str, Any]]) -> None:
        ckpts = self.output_dir / "checkpoints"
        final = next(
            (p for p in (ckpts / "final", ckpts / "best") if (p / "trainer_state.json").exists()),
            None,
        )
        with tempfile.TemporaryDirectory() as tmp:
            if final is not None:
                manifest = Path(tmp) / "checkpoint_manifest.json"
                manifest.write_text(json.dumps(checkpoint_manifest(final.resolve()), indent=1))
                self.mlflow.log_artifact(str(manifest))
                self.mlflow.log_artifact(str(final / "trainer_state.json"), "checkpoint")
            plot = Path(tmp) / "curves.png"
            plot.write_bytes(curves_png(records))
            self.mlflow.log_artifact(str(plot), "plots")
        self.mlflow.log_artifact(str(self.output_dir / "metrics.jsonl"))
        self.mlflow.end_run()


class TensorBoardSink:
    def __init__(self, output_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError(
                "logging.tensorboard=true needs `pip install edgetrain[tracking]`"
            ) from e
        self.writer = SummaryWriter(str(output_dir / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self, records: list[dict[str, Any]]) -> None:
        self.writer.close()
