"""Experiment tracking sinks beside metrics.jsonl: MLflow, W&B, TensorBoard, system metrics.

Every sink receives the same metric names as metrics.jsonl (``train/loss``, ``eval/acc``,
``sys/rss_mb`` ...). MLflow's embedded default is a SQLite store in the run's folder
(``output_dir/mlflow.db``, artefacts in ``output_dir/mlartifacts``); set
``logging.mlflow_tracking_uri`` to a tracking server's URL (or another database) to share one.
W&B runs offline by default, in ``output_dir/wandb/`` (``wandb sync`` uploads them later).
At the end of a run the MLflow and W&B sinks attach the same artefacts (``write_artefacts``):
the final checkpoint's manifest (each file's size and sha256, step, config digest, metrics),
its trainer_state.json, metrics.jsonl and a plot of the curves; and they record how the run
ended: FINISHED, FAILED (an exception) or KILLED (a stop signal, Ctrl-C).

A run opened inside ``trial_tracking(TrialTracking(...))`` (a trial of ``hpc-train tune``)
belongs to its study: in MLflow it is nested under the study's parent run
(``mlflow.parentRunId``) and tagged ``edgetrain.study``/``edgetrain.trial``; in W&B the study is
its ``group``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpc_core.config import WandbConfig
from registry.atomic import write_bytes_atomic

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
"""How a run ended, in MLflow's words: FAILED = an exception, KILLED = a signal or Ctrl-C."""


EXPERIMENT = "edgetrain"
"""The MLflow experiment every run logs into."""
STUDY_TAG = "edgetrain.study"
"""MLflow tag naming the study of a parent run and of its trials' runs."""
TRIAL_TAG = "edgetrain.trial"
"""MLflow tag: the trial's number, on a trial's run."""
TRIAL_STATE_TAG = "edgetrain.trial_state"
"""MLflow tag: how the trial ended (COMPLETE, PRUNED, FAIL); a pruned trial's run is FINISHED."""


@dataclass
class TrialTracking:
    """The study a trial's tracking runs belong to, and what the trial tells them."""

    study: str
    trial: int
    mlflow_parent_run_id: str | None = None
    """The study's MLflow parent run: the trial's run is nested under it."""
    state: str | None = None
    """Set when the trial's end is known before its run closes (PRUNED): tagged on the run."""


_TRIAL: ContextVar[TrialTracking | None] = ContextVar("edgetrain_trial_tracking", default=None)


@contextlib.contextmanager
def trial_tracking(trial: TrialTracking) -> Iterator[TrialTracking]:
    """Runs opened inside belong to ``trial``'s study (this thread or task only)."""
    token = _TRIAL.set(trial)
    try:
        yield trial
    finally:
        _TRIAL.reset(token)


def current_trial() -> TrialTracking | None:
    """The trial whose runs this thread opens, if any."""
    return _TRIAL.get()


class SystemSampler:
    """CPU use of this process since the last sample, its RSS, and the GPU's use and memory."""

    def __init__(self) -> None:
        import torch  # not at import: the tune driver reads this module's tags without torch

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
            import torch

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


def write_artefacts(output_dir: Path, records: list[dict[str, Any]], dest: Path) -> list[Path]:
    """Write the run's artefacts under ``dest``, the same for every sink, and return their
    paths: metrics.jsonl, plots/curves.png and, when the run saved a final (else best)
    checkpoint, checkpoint_manifest.json and checkpoint/trainer_state.json."""
    written = [dest / "metrics.jsonl", dest / "plots/curves.png"]
    ckpts = output_dir / "checkpoints"
    final = next(
        (p for p in (ckpts / "final", ckpts / "best") if (p / "trainer_state.json").exists()),
        None,
    )
    if final is not None:
        manifest = json.dumps(checkpoint_manifest(final.resolve()), indent=1)
        (dest / "checkpoint_manifest.json").write_text(manifest)
        (dest / "checkpoint").mkdir(exist_ok=True)
        shutil.copyfile(final / "trainer_state.json", dest / "checkpoint/trainer_state.json")
        written += [dest / "checkpoint_manifest.json", dest / "checkpoint/trainer_state.json"]
    (dest / "plots").mkdir(exist_ok=True)
    (dest / "plots/curves.png").write_bytes(curves_png(records))
    shutil.copyfile(output_dir / "metrics.jsonl", dest / "metrics.jsonl")
    return written


class MlflowSink:
    # Present while a run is open: found at the next start, it means the process that opened
    # that run died without closing it (kill -9, the OOM killer), so the run is marked FAILED.
    OPEN_RUN = "mlflow_open_run.json"

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
        self._close_dead_run()
        name = EXPERIMENT
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
        self.trial = current_trial()
        if self.trial is None:
            self.run = mlflow.start_run(run_name=run_name)
        else:
            self.run = mlflow.start_run(
                run_name=run_name,
                parent_run_id=self.trial.mlflow_parent_run_id,
                tags={STUDY_TAG: self.trial.study, TRIAL_TAG: str(self.trial.trial)},
            )
        record = {"run_id": self.run.info.run_id, "tracking_uri": uri}
        write_bytes_atomic(output_dir / self.OPEN_RUN, json.dumps(record).encode())
        mlflow.log_params(params)
        log.info("mlflow run %s in %s", self.run.info.run_id, uri)

    def _close_dead_run(self) -> None:
        path = self.output_dir / self.OPEN_RUN
        if not path.exists():
            return
        record = json.loads(path.read_text())
        client = self.mlflow.tracking.MlflowClient(tracking_uri=record["tracking_uri"])
        run = client.get_run(record["run_id"])
        if run.info.status == "RUNNING":
            error = "the process died without closing the run (killed: SIGKILL or out of memory)"
            client.set_tag(run.info.run_id, "error", error)
            client.set_terminated(run.info.run_id, "FAILED")
            log.warning("mlflow run %s was left RUNNING: marked FAILED", run.info.run_id)
        path.unlink()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self, records: list[dict[str, Any]], status: RunStatus, error: str | None) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            write_artefacts(self.output_dir, records, Path(tmp))
            self.mlflow.log_artifacts(tmp)
        if error is not None:
            self.mlflow.set_tag("error", error[:5000])  # MLflow's limit for a tag's value
        if self.trial is not None and self.trial.state is not None:
            self.mlflow.set_tag(TRIAL_STATE_TAG, self.trial.state)
        self.mlflow.end_run(status)
        (self.output_dir / self.OPEN_RUN).unlink(missing_ok=True)


class WandbSink:
    """Weights & Biases: the same params, metrics and artefacts as MLflow. Offline by default:
    the run is written to ``output_dir/wandb/offline-run-*/`` and nothing leaves the machine."""

    def __init__(
        self, output_dir: Path, cfg: WandbConfig, run_name: str, params: dict[str, Any]
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("logging.wandb needs `pip install edgetrain[tracking]`") from e
        self.output_dir = output_dir
        self.trial = current_trial()
        self.run = wandb.init(
            project=cfg.project,
            name=run_name,
            # A tune trial's run: its study is the group, as W&B's sweeps group theirs.
            group=self.trial.study if self.trial is not None else None,
            job_type="trial" if self.trial is not None else None,
            mode=cfg.mode,
            dir=output_dir,
            config=params,
            # console=off: W&B would otherwise wrap the process's stdout and stderr; the
            # training log already goes where the user sends it.
            settings=wandb.Settings(console="off", silent=True, save_code=False, disable_git=True),
        )
        # Our step as the x-axis: W&B's own step may only grow, and after a rollback the
        # trainer logs earlier steps again.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        log.info("wandb run %s (%s) in %s", self.run.id, cfg.mode, self.run.dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"step": step, **metrics})

    def close(self, records: list[dict[str, Any]], status: RunStatus, error: str | None) -> None:
        # Files in the run's folder are the run's files: W&B uploads them (now, or at sync).
        files = Path(self.run.dir)
        for f in write_artefacts(self.output_dir, records, files):
            self.run.save(str(f), base_path=str(files), policy="now")
        self.run.summary["status"] = status
        if self.trial is not None and self.trial.state is not None:
            self.run.summary["trial_state"] = self.trial.state
        if error is not None:
            self.run.summary["error"] = error
        if status == "KILLED":
            self.run.mark_preempting()
        # W&B has no KILLED state: a non-zero exit code is FAILED, and the summary says which.
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


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

    def close(self, records: list[dict[str, Any]], status: RunStatus, error: str | None) -> None:
        self.writer.close()
