"""Fault detection and injection: preemption signals, non-finite values, out-of-memory.

Every fault the trainer handles can be injected, so tests exercise the real recovery path.
Injection is read from the environment (it must reach torchrun's workers) or passed in:

    HPC_FAULT_NAN_STEP=N        the loss of optimizer step N is NaN (once per process)
    HPC_FAULT_OOM_STEP=N        from step N on, micro-batches larger than HPC_FAULT_OOM_ABOVE
    HPC_FAULT_OOM_ABOVE=M       raise torch.OutOfMemoryError (M unset: only step N's first try)
    HPC_FAULT_SIGTERM_STEP=N    the process sends itself SIGTERM after step N (preemption)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from types import FrameType

import torch

# Jetson's unified memory often reports exhaustion as an NVML assert, not a CUDA OOM.
# The CPU allocator says "not enough memory" (rare: Linux usually overcommits, then kills).
_OOM_MARKERS = ("out of memory", "NVML_SUCCESS == r INTERNAL ASSERT FAILED", "not enough memory")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MARKERS)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer step") from None


@dataclass
class FaultInjector:
    nan_step: int | None = None
    oom_step: int | None = None
    oom_above: int | None = None
    sigterm_step: int | None = None
    _fired: set[str] = field(default_factory=set)

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(
            nan_step=_env_int("HPC_FAULT_NAN_STEP"),
            oom_step=_env_int("HPC_FAULT_OOM_STEP"),
            oom_above=_env_int("HPC_FAULT_OOM_ABOVE"),
            sigterm_step=_env_int("HPC_FAULT_SIGTERM_STEP"),
        )

    def _once(self, key: str) -> bool:
        if key in self._fired:
            return False
        self._fired.add(key)
        return True

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.nan_step == step and self._once("nan"):
            return loss * float("nan")
        return loss

    def maybe_oom(self, step: int, micro_batch: int) -> None:
        if self.oom_step is None or step < self.oom_step:
            return
        if self.oom_above is not None:
            if micro_batch > self.oom_above:
                raise torch.OutOfMemoryError(
                    f"injected OOM: micro-batch {micro_batch} > {self.oom_above}"
                )
        elif self._once("oom"):
            raise torch.OutOfMemoryError(f"injected OOM at step {step}")

    def after_step(self, step: int) -> None:
        if self.sigterm_step == step and self._once("sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)


class StopSignals:
    """Turns SIGTERM/SIGUSR1 into a flag the loop checks at the next step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous.clear()
