"""``hpc-train convert-weights``: a .pth state dict becomes a safetensors file whose printed
sha256 pins it in ``model.weights``; anything but tensors in the pickle is refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_core.cli import main


def test_a_wrapped_pth_becomes_safetensors_with_its_sha256(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"conv.weight": torch.randn(4, 3, 3, 3), "fc.bias": torch.arange(10.0)}
    src, dst = tmp_path / "m.pth", tmp_path / "m.safetensors"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, src)
    assert main(["convert-weights", str(src), str(dst)]) == 0
    digest = hashlib.sha256(dst.read_bytes()).hexdigest()
    assert f"2 tensors, sha256 {digest}" in capsys.readouterr().out
    got = load_file(str(dst))
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    # An existing output is never overwritten.
    assert main(["convert-weights", str(src), str(dst)]) == 2
    assert "exists" in capsys.readouterr().err


def test_a_pickle_holding_more_than_tensors_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil = tmp_path / "evil.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, "x": object()}, evil)
    assert main(["convert-weights", str(evil), str(tmp_path / "out.safetensors")]) == 2
    assert "weights-only" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()
