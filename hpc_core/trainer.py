"""The training loop: one explicit loop shared by upstream DDP jobs and on-device fine-tunes.

Read it top to bottom: ``__init__`` runs the named set-up steps, ``train`` walks epochs and
steps, ``train_step`` does one optimizer step (micro-batches, accumulation, clipping, fault
handling), ``evaluate`` measures, ``save``/``load`` persist. Variation comes from the config
and from small hooks (``TrainerHook``), never from subclasses. What differs between tasks
(the data and its batches, the loss, the metrics) is the task's (``hpc_core.tasks``,
``cfg.task``): the loop calls it and never asks which task it runs.

Faults handled here (see ``hpc_core.faults`` for how to inject each one):
- SIGTERM / SIGUSR1: checkpoint at the next step boundary and return (exit 0: preemption).
- Non-finite loss or gradient norm: restore the last good checkpoint, scale the LR by
  ``faults.nan_lr_scale``, at most ``faults.max_nan_rollbacks`` times.
- Out of memory: halve the micro-batch, keep the global batch through accumulation, retry the
  same step; all ranks agree before shrinking (MosaicML Composer's scheme). Never grows back.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset

from hpc_core import checkpoint as ckpt
from hpc_core.config import ScheduleConfig, TrainConfig
from hpc_core.data import ResumableSampler, eval_shard, make_loader, steps_per_epoch
from hpc_core.distributed import all_reduce_max, barrier, init_distributed
from hpc_core.faults import FaultInjector, StopSignals, is_oom
from hpc_core.metrics import MetricsLogger, peak_device_mb, peak_rss_mb, want_progress
from hpc_core.models import build_model
from hpc_core.tasks import get_task
from hpc_core.tasks.base import Task

if TYPE_CHECKING:
    from hpc_core.tracking import RunStatus

log = logging.getLogger(__name__)


class TrainerHook(Protocol):
    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """Called on every rank after each optimizer step; may sleep to pace training."""


class TrainingDiverged(RuntimeError):
    """Non-finite loss or gradients persisted through every allowed rollback."""


@dataclass
class TrainState:
    """Everything besides tensors that a resume needs; saved in trainer_state.json."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    lr_scale: float = 1.0
    micro_batch_size: int = 0
    nan_rollbacks: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    es_best: float | None = None
    """Best value of the early-stopping metric so far (survives a resume)."""
    evals_since_best: int = 0


@dataclass
class TrainResult:
    final_step: int
    metrics: dict[str, float]
    stopped_reason: str
    """completed | early_stopping | SIGTERM | SIGUSR1 | requested: <reason>"""
    checkpoint_dir: Path | None


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak LR for the 0-based optimizer step ``step``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        *,
        model: nn.Module | None = None,
        datasets: tuple[Dataset, Dataset] | None = None,
        hooks: Sequence[TrainerHook] = (),
        faults: FaultInjector | None = None,
    ) -> None:
        self.cfg = cfg.model_copy(deep=True)
        self.dist = init_distributed(
            cfg.training.device, cfg.distributed.backend, cfg.distributed.timeout_s
        )
        self.device = self.dist.device
        if cfg.run.deterministic:
            if self.device.type == "cuda":
                # cuBLAS picks its reduction order per workspace: deterministic algorithms
                # refuse every matmul unless it is fixed before the first handle is made.
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        seed_everything(cfg.run.seed)
        self.hooks = list(hooks)
        self.faults = faults if faults is not None else FaultInjector.from_env()
        self.signals = StopSignals()
        self._stop_request: str | None = None
        self._agreed_stop = False
        self.ckpt_root = cfg.run.output_dir / "checkpoints"
        # Everything that differs between tasks (data, loss, metrics) goes through this.
        self.task: Task = get_task(cfg.task)
        self._setup_data(datasets)
        self._setup_model(model)
        self._setup_optimizer()
        self._setup_precision()
        self.state = TrainState(micro_batch_size=self._initial_micro_batch())
        self.logger = (
            MetricsLogger(cfg.run.output_dir, cfg.logging, cfg.run.name, self.cfg.to_dict())
            if self.dist.is_main
            else None
        )
        self.last_eval: dict[str, float] = {}

    # -----------------------------------------------------------------------------------------
    # Set-up

    def _setup_data(self, datasets: tuple[Dataset, Dataset] | None) -> None:
        t = self.cfg.training
        if datasets is None:
            self.train_ds, self.val_ds, info = self.task.build_datasets(self.cfg.data)
        else:
            self.train_ds, self.val_ds = datasets
            info = self.task.infer_info(self.train_ds, self.val_ds, self.cfg.model.num_classes)
        self.info = info
        m = self.cfg.model
        m.num_classes = m.num_classes or info.num_classes
        m.in_channels = m.in_channels or info.in_channels
        m.image_size = m.image_size or info.image_size
        W = self.dist.world_size
        if t.global_batch_size % W:
            raise ValueError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by the "
                f"world size {W}: make it a multiple of {W}"
            )
        self.per_rank_batch = t.global_batch_size // W
        self.steps_per_epoch = steps_per_epoch(len(self.train_ds), t.global_batch_size)  # type: ignore[arg-type]
        self.total_steps = t.max_steps or (t.epochs or 1) * self.steps_per_epoch
        self.sampler = ResumableSampler(self.train_ds, W, self.dist.rank, seed=self.cfg.run.seed)
        self.train_loader = make_loader(
            self.train_ds, self.per_rank_batch, self.cfg.data, sampler=self.sampler,
            collate_fn=self.task.collate,
        )

    def _setup_model(self, model: nn.Module | None) -> None:
        m = self.cfg.model
        if model is None:
            model = build_model(
                m.name,
                num_classes=m.num_classes,
                in_channels=m.in_channels,  # type: ignore[arg-type]
                image_size=m.image_size,
                **m.kwargs,  # type: ignore[arg-type]
            )
            if m.weights is not None:  # sha256 checked; a resume below loads over it
                from hpc_core.vision.weights import load_pretrained

                load_pretrained(model, m.weights)
        self.raw_model = model.to(self.device)
        if self.cfg.training.channels_last:
            self.raw_model.to(memory_format=torch.channels_last)  # 4-D tensors, in place
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (all requires_grad=False)")
        # FedProx's anchor: the weights as given, before any resume loads later ones.
        self.anchor = ([p.detach().clone() for p in self.params]
                       if self.cfg.training.proximal_mu > 0 else [])
        self.model: nn.Module = self.raw_model
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DDP(self.raw_model, device_ids=ids)

    def _setup_optimizer(self) -> None:
        o = self.cfg.optimizer
        if o.name == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
            )
        else:
            self.optimizer = torch.optim.SGD(
                self.params,
                lr=o.lr,
                momentum=o.momentum,
                nesterov=o.nesterov,
                weight_decay=o.weight_decay,
            )

    def _setup_precision(self) -> None:
        p = self.cfg.training.precision
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(p)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=p == "fp16")

    def _initial_micro_batch(self) -> int:
        mb = self.cfg.training.micro_batch_size or self.per_rank_batch
        if mb > self.per_rank_batch:
            raise ValueError(
                f"training.micro_batch_size={mb} exceeds the per-rank batch {self.per_rank_batch} "
                f"(global {self.cfg.training.global_batch_size} / {self.dist.world_size} ranks)"
            )
        return mb

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _set_train_mode(self) -> None:
        self.raw_model.train()
        # Frozen BatchNorm stays in eval mode: micro-batches must not move statistics that
        # nothing trains (on-device fine-tunes of the head or last blocks).
        for mod in self.raw_model.modules():
            params = list(mod.parameters(recurse=False))
            if isinstance(mod, _BatchNorm) and params and not any(p.requires_grad for p in params):
                mod.eval()

    # -----------------------------------------------------------------------------------------
    # The loop

    def request_stop(self, reason: str) -> None:
        """Checkpoint and return at the next step boundary (used by hooks, e.g. a governor)."""
        self._stop_request = f"requested: {reason}"

    def train(self, resume: str | Path | None = None) -> TrainResult:
        if resume is not None:
            self._resume(resume)
        if ckpt.find_latest(self.ckpt_root) is None and self.state.step == 0:
            # Something to roll back to before the first checkpoint exists.
            self._snapshot: dict[str, Any] | None = self._capture(copy=True)
        else:
            self._snapshot = None
        if self.cfg.faults.handle_signals:
            self.signals.install()
        self._set_train_mode()
        progress = None
        if self.dist.is_main and want_progress(self.cfg.logging.progress):
            from tqdm import tqdm

            progress = tqdm(
                total=self.total_steps, initial=self.state.step, unit="step", dynamic_ncols=True
            )
        log.info(
            "training %s: %d steps, %d/epoch, global batch %d, micro-batch %d, %d rank(s)",
            self.cfg.model.name,
            self.total_steps,
            self.steps_per_epoch,
            self.cfg.training.global_batch_size,
            self.state.micro_batch_size,
            self.dist.world_size,
        )
        reason = "completed"
        # How the run ended, for the tracking sinks: FAILED unless it returns.
        status: RunStatus = "FAILED"
        error: str | None = None
        try:
            while self.state.step < self.total_steps:
                outcome = self._run_epoch(progress)
                if outcome == "rollback":
                    continue
                if outcome is not None:
                    reason = outcome
                    break
            result = self._finish(reason)
            stopped_by_signal = reason in {s.name for s in StopSignals.SIGNALS}
            status = "KILLED" if stopped_by_signal else "FINISHED"
            return result
        except BaseException as e:
            status = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"
            error = f"{type(e).__name__} after step {self.state.step}: {e}"
            raise
        finally:
            self.signals.uninstall()
            if progress is not None:
                progress.close()
            if self.logger is not None:
                self.logger.close(status, error)

    def _run_epoch(self, progress: Any) -> str | None:
        """Steps until the epoch ends (None), a rollback ("rollback") or a stop (its reason)."""
        st = self.state
        self.sampler.set_epoch(st.epoch, start_index=st.batch_in_epoch * self.per_rank_batch)
        # Worker seeds come from the loader's own generator: tie them to the epoch for resume.
        self.train_loader.generator.manual_seed(self.cfg.run.seed + st.epoch)
        remaining = min(self.steps_per_epoch - st.batch_in_epoch, self.total_steps - st.step)
        window = _Window()
        for x, y in itertools.islice(iter(self.train_loader), remaining):
            out = self.train_step(x, y)
            if out is None:
                return "rollback"
            st.step += 1
            st.batch_in_epoch += 1
            epoch_done = st.batch_in_epoch == self.steps_per_epoch
            if epoch_done:
                st.epoch += 1
                st.batch_in_epoch = 0
            window.add(out["loss"], self.cfg.training.global_batch_size)
            metrics = {
                "train/loss": out["loss"],
                "train/grad_norm": out["grad_norm"],
                "lr": out["lr"],
            }
            if st.step % self.cfg.logging.log_every_steps == 0 or st.step == self.total_steps:
                self._log({**metrics, **window.flush(self.device)})
            if self._eval_due(epoch_done):
                metrics.update(self.evaluate())
                if self._after_eval():
                    return "early_stopping"
            if self.cfg.checkpoint.every_steps and st.step % self.cfg.checkpoint.every_steps == 0:
                self.save()
            if progress is not None:
                progress.update(1)
                gate = self.task.gate_metric
                shown = self.last_eval.get(f"eval/{gate}")
                progress.set_postfix(
                    loss=f"{out['loss']:.4f}",
                    **({gate: f"{shown:.3f}"} if shown is not None else {}),
                )
            for hook in self.hooks:
                hook.on_step_end(self, st.step, metrics)
            self.faults.after_step(st.step)
            stop = self._pending_stop()
            if stop is not None:
                self.save()
                return stop
        return None

    def train_step(self, x: Any, y: Any) -> dict[str, float] | None:
        """One optimizer step over this rank's batch (as the task's ``collate`` made it);
        None when it was rolled back."""
        step = self.state.step + 1
        while True:
            oom = False
            loss: torch.Tensor | None = None
            try:
                loss = self._forward_backward(x, y, step)
            except Exception as e:
                if not is_oom(e):
                    raise
                oom = True
            bad_loss = loss is not None and not bool(torch.isfinite(loss))
            stop_now = self._pending_stop(local=True) is not None
            # One collective per step carries every flag the ranks must agree on.
            any_oom, any_stop, any_bad = all_reduce_max(
                [int(oom), int(stop_now), int(bad_loss)], self.dist
            )
            self._agreed_stop = bool(any_stop)
            if any_oom:
                self._shrink_micro_batch(step)
                continue
            break
        assert loss is not None
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        self._proximal_gradient()
        max_norm = self.cfg.training.grad_clip_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        # With fp16 an inf gradient is the GradScaler's business (it skips the step); a NaN
        # loss is not.
        bad_grad = not math.isfinite(grad_norm) and not self.scaler.is_enabled()
        if any_bad or bad_grad:
            self.optimizer.zero_grad(set_to_none=True)
            self._rollback(step, "loss" if any_bad else "gradient norm")
            return None
        lr = (
            self.cfg.optimizer.lr
            * self.state.lr_scale
            * lr_factor(step - 1, self.total_steps, self.cfg.schedule)
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss), "grad_norm": grad_norm, "lr": lr}

    def _forward_backward(self, x: Any, y: Any, step: int) -> torch.Tensor:
        """Accumulate gradients of the mean loss over ``x`` in micro-batches; return that loss."""
        task = self.task
        n = task.batch_len(x)
        mb = self.state.micro_batch_size
        total = torch.zeros((), device=self.device)
        for start in range(0, n, mb):
            xm, ym = task.to_device(*task.split(x, y, start, start + mb), self.device)
            size = task.batch_len(xm)
            last = start + mb >= n
            # Gradients are all-reduced once, on the last micro-batch.
            sync = (
                self.model.no_sync()
                if (self.dist.enabled and not last)
                else contextlib.nullcontext()
            )
            with sync:
                self.faults.maybe_oom(step, size)
                loss = task.loss(self.model, xm, ym, autocast=self._autocast)
                loss = self.faults.corrupt_loss(step, loss)
                # Weight by the micro-batch's share, so the sum is the mean over the full batch.
                self.scaler.scale(loss * (size / n)).backward()
            total += loss.detach() * size
        return total / n

    @torch.no_grad()
    def _proximal_gradient(self) -> None:
        """Add the gradient of (mu / 2) * ||w - anchor||^2, mu * (w - anchor), to the unscaled
        gradients: the same step as putting the term in the loss, without the autograd."""
        if not self.anchor:
            return
        mu = self.cfg.training.proximal_mu
        for p, p0 in zip(self.params, self.anchor, strict=True):
            if p.grad is not None:
                p.grad.add_(p.detach() - p0, alpha=mu)

    def _shrink_micro_batch(self, step: int) -> None:
        old = self.state.micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        new = old // 2
        if new < self.cfg.faults.min_micro_batch_size:
            raise RuntimeError(
                f"out of memory at step {step} with micro-batch {old}; faults.min_micro_batch_size="
                f"{self.cfg.faults.min_micro_batch_size} forbids going lower: use a smaller model "
                "or input size"
            )
        self.state.micro_batch_size = new
        log.warning(
            "out of memory at step %d: micro-batch %d -> %d, retrying the step", step, old, new
        )
        if self.logger is not None:
            self.logger.event(step, "oom", micro_batch_from=old, micro_batch_to=new)

    def _rollback(self, step: int, what: str) -> None:
        st = self.state
        if st.nan_rollbacks >= self.cfg.faults.max_nan_rollbacks:
            raise TrainingDiverged(
                f"non-finite {what} at step {step} after {st.nan_rollbacks} rollback(s) "
                f"(faults.max_nan_rollbacks={self.cfg.faults.max_nan_rollbacks}): lower "
                "optimizer.lr, enable training.grad_clip_norm, or check the data"
            )
        latest = ckpt.find_latest(self.ckpt_root)
        lr_scale = st.lr_scale * self.cfg.faults.nan_lr_scale
        rollbacks = st.nan_rollbacks + 1
        if latest is not None:
            self.load(latest)
            source = str(latest)
        elif self._snapshot is not None:
            self._restore(self._snapshot)
            source = "initial state"
        else:
            raise TrainingDiverged(f"non-finite {what} at step {step} and no checkpoint to restore")
        self.state.lr_scale, self.state.nan_rollbacks = lr_scale, rollbacks
        log.warning(
            "non-finite %s at step %d: restored %s (step %d), LR scale now %.3g",
            what,
            step,
            source,
            self.state.step,
            lr_scale,
        )
        if self.logger is not None:
            self.logger.event(
                step,
                "rollback",
                what=what,
                restored_step=self.state.step,
                lr_scale=lr_scale,
                rollbacks=rollbacks,
            )

    def _pending_stop(self, local: bool = False) -> str | None:
        if self.dist.enabled and not local:
            # Ranks act on the flag they agreed on in this step's collective, not on what
            # each one has seen since: they must all stop at the same step.
            return (
                (self.signals.received or self._stop_request or "SIGTERM")
                if self._agreed_stop
                else None
            )
        return self.signals.received or self._stop_request

    def _finish(self, reason: str) -> TrainResult:
        if not self.last_eval or self.last_eval.get("step") != self.state.step:
            self.evaluate()
        final = None
        if reason in ("completed", "early_stopping") and self.cfg.checkpoint.save_final:
            final = self.save(self.ckpt_root / "final")
        elif reason not in ("completed", "early_stopping"):
            final = ckpt.find_latest(self.ckpt_root)
        barrier(self.dist)
        metrics = {k: v for k, v in self.last_eval.items() if k != "step"}
        log.info(
            "stopped (%s) at step %d: %s",
            reason,
            self.state.step,
            ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
        )
        return TrainResult(self.state.step, metrics, reason, final)

    # -----------------------------------------------------------------------------------------
    # Evaluation

    def _eval_due(self, epoch_done: bool) -> bool:
        every = self.cfg.training.eval_every_steps
        due = epoch_done if every is None else self.state.step % every == 0
        return due or self.state.step == self.total_steps

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's metrics on the validation split (sharded over ranks, combined by the
        task's evaluation): eval/loss and eval/acc, or eval/map, eval/map50, ..."""
        # The unwrapped module: DDP's forward would broadcast buffers, a collective that
        # uneven shards would call a different number of times per rank.
        idx = eval_shard(len(self.val_ds), self.dist.rank, self.dist.world_size)  # type: ignore[arg-type]
        loader = make_loader(Subset(self.val_ds, idx), self.state.micro_batch_size, self.cfg.data,
                             collate_fn=self.task.collate)
        result = self.task.evaluate(self.raw_model, loader, self.device, self.dist,
                                    self._autocast)
        self._set_train_mode()
        self.last_eval = {f"eval/{k}": v for k, v in result.items()}
        self._log(self.last_eval)
        self.last_eval["step"] = float(self.state.step)
        return {k: v for k, v in self.last_eval.items() if k != "step"}

    def _after_eval(self) -> bool:
        """Track the best checkpoint and early stopping; True means stop now."""
        st, c, es = self.state, self.cfg.checkpoint, self.cfg.training.early_stopping
        if c.best_metric is not None and c.best_metric in self.last_eval:
            value = self.last_eval[c.best_metric]
            # nan (mAP of a split without objects) is never a best, and never improves.
            if not math.isnan(value) and (
                st.best_metric is None or _better(value, st.best_metric, c.best_mode, 0.0)
            ):
                st.best_metric, st.best_step = value, st.step
                path = self.save()
                if self.dist.is_main:
                    ckpt.set_best(self.ckpt_root, path)
        if es.patience is None or es.metric not in self.last_eval:
            return False
        value = self.last_eval[es.metric]
        if not math.isnan(value) and (
            st.es_best is None or _better(value, st.es_best, es.mode, es.min_delta)
        ):
            st.es_best = value
            st.evals_since_best = 0
            return False
        st.evals_since_best += 1
        return st.evals_since_best >= es.patience

    def _log(self, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(self.state.step, metrics)

    # -----------------------------------------------------------------------------------------
    # Save / load

    def _capture(self, copy: bool) -> dict[str, Any]:
        def cpu(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=copy)

        opt = self.optimizer.state_dict()
        if copy:
            opt = {
                "state": {
                    i: {k: cpu(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                    for i, s in opt["state"].items()
                },
                "param_groups": [dict(g) for g in opt["param_groups"]],
            }
        return {
            "model": {k: cpu(v) for k, v in self.raw_model.state_dict().items()},
            "optimizer": opt,
            "scaler": self.scaler.state_dict(),
            "rng": ckpt.capture_rng(),
            "train_state": asdict(self.state),
        }

    def _restore(self, snap: dict[str, Any]) -> None:
        self.raw_model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        if snap.get("scaler"):
            self.scaler.load_state_dict(snap["scaler"])
        ckpt.restore_rng(*snap["rng"])
        self.state = TrainState(**snap["train_state"])

    def save(self, dest: Path | None = None) -> Path:
        """Checkpoint the current step (rank 0 writes; all ranks wait for it)."""
        dest = dest or ckpt.step_dir(self.ckpt_root, self.state.step)
        barrier(self.dist)
        if self.dist.is_main:
            snap = self._capture(copy=False)
            ckpt.save_checkpoint(
                dest,
                model_state=snap["model"],
                optimizer_state=snap["optimizer"],
                rng=snap["rng"],
                trainer_state={
                    "step": self.state.step,
                    "epoch": self.state.epoch,
                    "train_state": snap["train_state"],
                    "scaler": snap["scaler"],
                    "config": self.cfg.to_dict(),
                    "config_digest": self.cfg.digest(),
                    "metrics": {k: v for k, v in self.last_eval.items() if k != "step"},
                    "world_size": self.dist.world_size,
                    "torch_version": torch.__version__,
                    "created_at": time.time(),
                },
            )
            if dest.name.startswith(ckpt.STEP_PREFIX):
                ckpt.prune_step_checkpoints(self.ckpt_root, self.cfg.checkpoint.keep_last)
        barrier(self.dist)
        return dest

    def load(self, path: Path) -> None:
        state = ckpt.read_trainer_state(path)
        self._restore(
            {
                "model": ckpt.load_tensors(path, "model.safetensors"),
                "optimizer": ckpt.optimizer_from_safetensors(
                    ckpt.load_tensors(path, "optimizer.safetensors"), state["optimizer"]
                ),
                "scaler": state.get("scaler"),
                "rng": (ckpt.load_tensors(path, "rng.safetensors"), state["rng"]),
                "train_state": state["train_state"],
            }
        )

    def _resume(self, resume: str | Path) -> None:
        if str(resume) == "auto":
            candidates = [
                p
                for p in (ckpt.find_latest(self.ckpt_root), self.ckpt_root / "final")
                if p is not None and ckpt.is_complete(p)
            ]
            if not candidates:
                log.info("resume=auto: no checkpoint under %s, starting fresh", self.ckpt_root)
                return
            path = max(candidates, key=lambda p: ckpt.read_trainer_state(p)["step"])
        else:
            path = ckpt.resolve_checkpoint(Path(resume))
        self.load(path)
        log.info("resumed from %s at step %d", path, self.state.step)


def _better(value: float, ref: float, mode: str, min_delta: float) -> bool:
    return value > ref + min_delta if mode == "max" else value < ref - min_delta


class _Window:
    """Mean loss and throughput between two log lines."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.t0 = time.perf_counter()
        self.losses: list[float] = []
        self.samples = 0

    def add(self, loss: float, samples: int) -> None:
        self.losses.append(loss)
        self.samples += samples

    def flush(self, device: torch.device) -> dict[str, float]:
        elapsed = time.perf_counter() - self.t0
        out = {
            "train/loss": sum(self.losses) / max(1, len(self.losses)),
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "mem/peak_rss_mb": peak_rss_mb(),
        }
        dev = peak_device_mb(device)
        if dev is not None:
            out["mem/peak_device_mb"] = dev
        self._reset()
        return out

