"""One trial of ``hpc-train tune --backend ray``, in a Ray worker process: Ray Tune's trainable
(``ray_trial``), a ``Trainer`` run of ``trial_config`` as the Optuna backend's, reporting each
evaluation with that step's safetensors checkpoint folder, and resumed from the last one it
reported when Ray restores it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray import tune

from hpc_core.config import config_from_dict
from hpc_core.tracking import TrialTracking, current_trial, trial_tracking
from hpc_core.tune.trial import check_metric_reported, trial_config, trial_value

# Not imported: hpc_core.trainer (torch) until a trial runs.

log = logging.getLogger("hpc_core.tune")  # one logger for every part of `hpc-train tune`

TRIAL_KEY = "trial_number"
"""Config key carrying the trial's number (its ``trial_NNNN`` folder), set by the searcher."""
LOCK_WAIT_S = 300.0
"""How long a trial waits for an earlier run of itself to end before it fails."""


@contextlib.contextmanager
def _sole_run(folder: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold ``folder``'s trial lock (a file beside it, ``flock``, released when this process
    ends however it ends). A driver killed mid-experiment leaves its trials running until Ray
    ends its job, seconds later; the restored experiment starts them again at once, and two
    runs of one trial in one folder delete each other's checkpoints (each prunes by step).
    The later run waits for the earlier one here."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder.parent / f".{folder.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{folder}: another run of this trial still holds it after {wait_s:.0f}"
                        " s (a dead driver's trial Ray has not ended)") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def _drop_later_checkpoints(root: Path, step: int) -> None:
    """Step checkpoints past ``step`` (the one a restored trial resumes from) that an earlier,
    ended run of the trial wrote: left there, they would outrank the resumed run's own in the
    trainer's pruning, which would then delete the checkpoint it is about to report."""
    from hpc_core import checkpoint as ckpt

    for p in ckpt.list_step_checkpoints(root):
        if int(ckpt.read_trainer_state(p)["step"]) > step:
            shutil.rmtree(p)


class _ReportHook:
    """Reports each evaluation to Ray with the checkpoint of that step; when Ray stops the
    trial (the scheduler pruned it) asks the trainer to stop at this step."""

    def __init__(self, metric: str, base_info: dict[str, Any]) -> None:
        self.metric = metric
        self.info = base_info
        self.stopped_at: int | None = None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        from hpc_core import checkpoint as ckpt

        check_metric_reported(self.metric, step, metrics)
        if self.metric not in metrics or self.stopped_at is not None:
            return
        if step >= trainer.total_steps:
            return  # the last evaluation is reported with the final checkpoint, after the run
        path = ckpt.step_dir(trainer.ckpt_root, step)
        if not ckpt.is_complete(path):
            trainer.save()
        try:
            _report(trainer, metrics, path, self.info, final=False)
        except SystemExit:
            # Ray's way of ending a trial it stopped: the report raises SystemExit in the
            # training thread. The trainer checkpoints, closes its tracking run and returns.
            self.stopped_at = step
            tracked = current_trial()
            if tracked is not None:
                tracked.state = "PRUNED"  # tagged on the trial's tracking runs as they close
            trainer.request_stop(f"stopped by the scheduler at step {step}")


def _report(
    trainer: Any, metrics: dict[str, float], path: Path | None, info: dict[str, Any], final: bool
) -> None:
    row = {k: (v if math.isfinite(v) else float("nan")) for k, v in metrics.items()
           if k.startswith("eval/")}  # fmt: skip
    row.update(info, step=trainer.state.step, final=int(final))
    checkpoint = tune.Checkpoint.from_directory(str(path)) if path is not None else None
    tune.report(row, checkpoint=checkpoint)


def ray_trial(
    config: dict[str, Any],
    *,
    base: dict[str, Any],
    metric: str,
    out: str,
    study: str,
    parent_run_id: str | None = None,
) -> None:
    """Ray Tune's trainable: one trial, ``trial_config`` trained by ``Trainer`` as the Optuna
    backend's, resumed from the last checkpoint it reported when Ray restores it; its tracking
    runs belong to ``study`` (nested under the MLflow run ``parent_run_id``)."""
    from hpc_core.trainer import Trainer

    params = dict(config)
    number = int(params.pop(TRIAL_KEY))
    cfg = trial_config(config_from_dict(base, source="base config"), params, Path(out), number)
    checkpoint = tune.get_checkpoint()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sole_run(cfg.run.output_dir))
        if checkpoint is None and cfg.run.output_dir.exists():
            # A start of this trial that the experiment never recorded (the driver died
            # first): its folder is this trial's, from scratch.
            shutil.rmtree(cfg.run.output_dir)
        resume = None
        if checkpoint is not None:
            resume = Path(stack.enter_context(checkpoint.as_directory()))
        info = {"worker": f"{socket.gethostname()}:{os.getpid()}", "start_step": 0}
        if resume is not None:
            info["start_step"] = _checkpoint_step(resume)
            _drop_later_checkpoints(cfg.run.output_dir / "checkpoints", info["start_step"])
            log.info("trial %d: resuming from step %d", number, info["start_step"])
        hook = _ReportHook(metric, info)
        stack.enter_context(trial_tracking(TrialTracking(study, number, parent_run_id)))
        trainer = Trainer(cfg, hooks=[hook])
        t0 = time.perf_counter()
        result = trainer.train(resume=resume)
        log.info("trial %d: %s at step %d in %.1f s", number, result.stopped_reason,
                 result.final_step, time.perf_counter() - t0)  # fmt: skip
        if hook.stopped_at is not None:
            # Ray stopped it: end the way Ray's report would have (SystemExit(0), a graceful
            # end), not by returning: a returning trainable reports once more and waits for Ray
            # to take that result, which a stopped trial's Ray never does. That wait kept the
            # thread alive, so an actor reused for the next trial never became free.
            raise SystemExit(0)
        # No value (metric missing or not finite) raises here: the trial fails.
        trial_value(result.metrics, metric, result.final_step)
        # Still holding the trial's lock: Ray copies the final checkpoint from its folder.
        _report(trainer, result.metrics, result.checkpoint_dir, info, final=True)


def _checkpoint_step(path: Path) -> int:
    from hpc_core import checkpoint as ckpt

    return int(ckpt.read_trainer_state(path)["step"])

