"""Metric sinks: metrics.jsonl always; TensorBoard, MLflow and W&B when configured."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc_core.config import LoggingConfig

if TYPE_CHECKING:
    from hpc_core.tracking import RunStatus


def peak_rss_mb() -> float:
    """This process's own resident-set high-water mark. Linux: VmHWM, which starts afresh
    with the address space at exec; ru_maxrss keeps the parent's high-water mark across
    fork + exec, so a probe started by a large process would report that process's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux, macOS: B


def reset_peak_rss() -> bool:
    """Start this process's VmHWM afresh from its current RSS (Linux >= 4.0: ``5`` written to
    ``/proc/self/clear_refs``), so a later ``peak_rss_mb`` measures one phase of its life.
    False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_device_mb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


class MetricsLogger:
    """Writes one JSON object per line: ``{"step": N, "time": unix_s, "<metric>": value, ...}``.

    TensorBoard, MLflow and W&B (``hpc_core.tracking``) get the same names. Each train/* line also
    carries system metrics (``sys/cpu_percent``, ``sys/rss_mb``, ``sys/gpu_*`` on CUDA).
    """

    def __init__(
        self, output_dir: Path, cfg: LoggingConfig, run_name: str, config: dict[str, Any]
    ) -> None:
        from hpc_core.tracking import MlflowSink, SystemSampler, TensorBoardSink, WandbSink

        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives as long as the logger; line-buffered so a crash loses no line
        self._system = SystemSampler()
        self._sinks: list[Any] = []
        if cfg.tensorboard:
            self._sinks.append(TensorBoardSink(output_dir))
        if cfg.mlflow:
            self._sinks.append(
                MlflowSink(output_dir, cfg.mlflow_tracking_uri, run_name, _flatten(config))
            )
        if cfg.wandb is not None:
            self._sinks.append(WandbSink(output_dir, cfg.wandb, run_name, _flatten(config)))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "train/loss" in metrics:
            metrics = {**metrics, **self._system.sample()}
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": round(time.time(), 3), **clean}) + "\n")
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        for sink in self._sinks:
            sink.log(step, finite)

    def event(self, step: int, kind: str, **fields: Any) -> None:
        """A discrete event (rollback, OOM, preemption) in the same stream."""
        self._file.write(
            json.dumps({"step": step, "time": round(time.time(), 3), "event": kind, **fields})
            + "\n"
        )

    def close(self, status: RunStatus = "FINISHED", error: str | None = None) -> None:
        """Close every sink, recording how the run ended (``error``: what failed it)."""
        self._file.close()
        if self._sinks:
            records = read_metrics(self.path)
            for sink in self._sinks:
                sink.close(records, status, error)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def want_progress(mode: str) -> bool:
    return mode == "on" or (mode == "auto" and sys.stderr.isatty())


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
