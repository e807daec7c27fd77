from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from hpc_core import checkpoint as ckpt
from hpc_core.trainer import Trainer


def _save(path: Path, step: int = 1) -> Path:
    model = torch.nn.Linear(3, 2)
    return ckpt.save_checkpoint(path, model_state=model.state_dict(), trainer_state={"step": step})


def test_incomplete_checkpoints_are_ignored(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _save(ckpt.step_dir(root, 10), 10)
    _save(ckpt.step_dir(root, 20), 20)
    # A crash after writing weights but before the marker.
    (ckpt.step_dir(root, 20) / ckpt.MARKER).unlink()
    # A crash while the temp dir was being filled.
    (root / ".tmp-step_00000030.999").mkdir()
    assert ckpt.find_latest(root) == ckpt.step_dir(root, 10)
    assert ckpt.resolve_checkpoint(tmp_path) == ckpt.step_dir(root, 10)
    with pytest.raises(ckpt.CheckpointError, match="COMPLETE"):
        ckpt.read_trainer_state(ckpt.step_dir(root, 20))


def test_resave_replaces_atomically(tmp_path: Path) -> None:
    p = _save(tmp_path / "final", 1)
    _save(p, 2)
    assert ckpt.read_trainer_state(p)["step"] == 2
    assert sorted(x.name for x in tmp_path.iterdir()) == ["final"]


def test_prune_keeps_last_and_best(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4, 5):
        _save(ckpt.step_dir(tmp_path, s), s)
    ckpt.set_best(tmp_path, ckpt.step_dir(tmp_path, 2))
    ckpt.prune_step_checkpoints(tmp_path, keep_last=2)
    kept = [p.name for p in ckpt.list_step_checkpoints(tmp_path)]
    assert kept == ["step_00000002", "step_00000004", "step_00000005"]
    assert ckpt.best_target(tmp_path) == ckpt.step_dir(tmp_path, 2)


def test_checkpoint_files_are_not_pickles(tmp_path: Path, make_config) -> None:
    t = Trainer(make_config(overrides=["optimizer.name=sgd", "optimizer.nesterov=true"]))
    path = t.train().checkpoint_dir
    for f in path.iterdir():
        head = f.read_bytes()[:2]
        assert head != b"\x80\x04" and head != b"PK", (
            f"{f.name} looks like a pickle/torch.save file"
        )
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["format"] == ckpt.FORMAT and state["step"] == 5
    assert state["config"]["model"]["num_classes"] == 10


def test_a_pickle_posing_as_weights_is_refused(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    with open(p / "model.safetensors", "wb") as f:
        pickle.dump({"weight": [1, 2]}, f)
    with pytest.raises(Exception, match=r"(?i)header|safetensor|invalid"):
        ckpt.load_tensors(p, "model.safetensors")


def test_optimizer_and_rng_state_round_trip(make_config) -> None:
    t = Trainer(make_config())
    t.train()
    tensors, meta = ckpt.optimizer_to_safetensors(t.optimizer.state_dict())
    back = ckpt.optimizer_from_safetensors(tensors, json.loads(json.dumps(meta)))
    orig = t.optimizer.state_dict()
    assert back["state"].keys() == orig["state"].keys()
    for i in orig["state"]:
        for k, v in orig["state"][i].items():
            assert torch.equal(back["state"][i][k], v)
    rng_t, rng_m = ckpt.capture_rng()
    a = torch.rand(3)
    ckpt.restore_rng(rng_t, json.loads(json.dumps(rng_m)))
    assert torch.equal(torch.rand(3), a)
