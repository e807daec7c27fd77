from __future__ import annotations

import os
import signal

import pytest
import torch

from hpc_core.faults import FaultInjector, StopSignals, is_oom


def test_oom_detection_covers_jetson_nvml_assert() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_oom(
        RuntimeError("NVML_SUCCESS == r INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp")
    )
    assert is_oom(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
            "you tried to allocate 1073741824 bytes."
        )
    )
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


def test_injection_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPC_FAULT_NAN_STEP", "4")
    monkeypatch.setenv("HPC_FAULT_OOM_STEP", "2")
    monkeypatch.setenv("HPC_FAULT_OOM_ABOVE", "8")
    f = FaultInjector.from_env()
    assert (f.nan_step, f.oom_step, f.oom_above, f.sigterm_step) == (4, 2, 8, None)
    assert torch.isnan(f.corrupt_loss(4, torch.tensor(1.0)))
    assert f.corrupt_loss(4, torch.tensor(1.0)) == 1.0  # once only: the replay is clean
    f.maybe_oom(1, 64)
    f.maybe_oom(2, 8)
    with pytest.raises(torch.OutOfMemoryError):
        f.maybe_oom(5, 16)
    monkeypatch.setenv("HPC_FAULT_NAN_STEP", "soon")
    with pytest.raises(ValueError, match="HPC_FAULT_NAN_STEP='soon' must be an integer"):
        FaultInjector.from_env()


def test_signals_become_a_flag() -> None:
    s = StopSignals()
    s.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert s.received == "SIGUSR1"
    finally:
        s.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is not s._handle
