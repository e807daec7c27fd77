"""Process-group set-up for torchrun (single node or multi-node c10d rendezvous).

torchrun exports RANK, WORLD_SIZE and LOCAL_RANK; without them we run as one process and
every collective here is a no-op, so the trainer has one code path.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device=cuda but no CUDA device is visible: use auto or cpu")
    if requested in ("cuda", "auto") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_request: str, backend: str, timeout_s: int) -> DistInfo:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_request, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise RuntimeError("distributed.backend=nccl needs CUDA devices: use gloo on CPU")
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_max(values: list[int], info: DistInfo) -> list[int]:
    """Element-wise max over ranks of small integer flags (one collective per call).

    int32, not bool: NCCL reduces integers, and MAX over 0/1 is a logical OR.
    """
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.int32, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def end_rank(code: int) -> int:
    """Under torchrun (WORLD_SIZE > 1) end this rank's process now with ``code``, without
    interpreter finalization; in one process return ``code``.

    Why: gloo's worker threads outlive ``destroy_process_group`` (torch keeps the backend
    alive), and the last collective's work object is freed on one of them. Its tensors were
    made in Python, so freeing them takes the GIL; when the main thread is finalizing the
    interpreter by then, CPython ends that worker thread inside a noexcept C++ frame and the
    whole process aborts (SIGABRT, "terminate called without an active exception") after the
    checkpoint and the result were written, and torchrun reports the rank failed. Seen about
    once in a hundred preempted 2-rank runs on a loaded 2-core host (a core dump showed the
    gloo thread in ``~AsyncBarrierWork`` waiting for the GIL, the main thread in
    ``Py_FinalizeEx``). Nothing is left to close by then: the trainer closed its trackers,
    checkpoints are written atomically; logging and stdio are flushed here.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
