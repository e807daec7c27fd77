"""Checkpoints on disk: safetensors + JSON, written atomically, never unpickled.

Layout of one checkpoint directory::

    model.safetensors       model.state_dict(), keys = state_dict keys
    optimizer.safetensors   optimizer tensor state, keys "state.<param>.<name>"
    rng.safetensors         torch CPU/CUDA and numpy generator states
    trainer_state.json      step, epoch, sampler position, python RNG, optimizer param groups,
                            scaler, metrics and the resolved config
    COMPLETE                written last; a directory without it is ignored

A run keeps them under ``<output_dir>/checkpoints/``: ``step_00000100/`` …, ``best`` (a
symlink to the best step directory) and ``final/``. The whole directory is built under a
temporary name, fsynced, then renamed into place, so a crash leaves either the old state or
the new one. The layout itself (finding, reading, pruning; torch-free) is
``hpc_core.checkpoint_layout``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hpc_core.checkpoint_layout import (  # noqa: F401 - the layout, re-exported for ckpt.X
    FORMAT,
    MARKER,
    STEP_PREFIX,
    CheckpointError,
    best_target,
    find_latest,
    is_complete,
    list_step_checkpoints,
    prune_step_checkpoints,
    read_trainer_state,
    resolve_checkpoint,
    set_best,
    step_dir,
)
from hpc_core.config import TrainConfig, config_from_dict
from hpc_core.models import build_model
from registry.atomic import TMP_PREFIX, fsync_dir, fsync_file


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    fsync_file(path)


# ---------------------------------------------------------------------------------------------
# Optimizer and RNG state <-> tensors + JSON


def optimizer_to_safetensors(
    state: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors and a JSON-able remainder."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_safetensors(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, extra in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(extra)
    return {"state": state, "param_groups": meta["param_groups"]}


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import random

    import numpy as np

    np_state = np.random.get_state()
    tensors = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype("int64")),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": {
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
    }
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    n = meta["numpy"]
    np.random.set_state(
        (
            "MT19937",
            tensors["numpy_keys"].numpy().astype("uint32"),
            n["pos"],
            n["has_gauss"],
            n["cached"],
        )
    )
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


# ---------------------------------------------------------------------------------------------
# Save / load


def save_checkpoint(
    dest: Path,
    *,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
) -> Path:
    """Write a complete checkpoint at ``dest`` atomically (replacing one that is there)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{TMP_PREFIX}{dest.name}.{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state = dict(trainer_state, format=FORMAT)
    _save_tensors(model_state, tmp / "model.safetensors")
    if optimizer_state is not None:
        opt_tensors, opt_meta = optimizer_to_safetensors(optimizer_state)
        _save_tensors(opt_tensors, tmp / "optimizer.safetensors")
        state["optimizer"] = opt_meta
    if rng is not None:
        _save_tensors(rng[0], tmp / "rng.safetensors")
        state["rng"] = rng[1]
    with open(tmp / "trainer_state.json", "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / MARKER, "w") as f:
        f.write(FORMAT + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    old = None
    if dest.exists():
        old = dest.parent / f"{TMP_PREFIX}old-{dest.name}.{os.getpid()}"
        os.replace(dest, old)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def load_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    file = Path(path) / name
    if not file.is_file():
        raise CheckpointError(f"{path}: {name} is missing")
    return load_file(str(file))


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[nn.Module, TrainConfig]:
    """Rebuild the model from the checkpoint's own config and load its weights."""
    state = read_trainer_state(path)
    cfg = config_from_dict(state["config"], source=f"{path}/trainer_state.json")
    m = cfg.model
    if None in (m.num_classes, m.in_channels, m.image_size):
        raise CheckpointError(
            f"{path}: config.model is not resolved (num_classes/in_channels/image_size)"
        )
    model = build_model(
        m.name,
        num_classes=m.num_classes,
        in_channels=m.in_channels,
        image_size=m.image_size,  # type: ignore[arg-type]
        **m.kwargs,
    )
    model.load_state_dict(load_tensors(path, "model.safetensors"), strict=True)
    return model.to(device), cfg
