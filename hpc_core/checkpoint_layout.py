"""A run's checkpoints on disk, torch-free: completeness, trainer_state.json, step/best/final.

``hpc_core.checkpoint`` writes and loads the tensors (torch); what only needs the layout -
finding the checkpoint a run or a path means, reading its trainer state, pruning old steps -
lives here, so that a device's stage step or a publish reads a checkpoint without paying
torch's import (~2 s and ~200 MB on a small board).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from registry.atomic import TMP_PREFIX

FORMAT = "edgetrain.checkpoint/1"
MARKER = "COMPLETE"
STEP_PREFIX = "step_"


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete or inconsistent."""


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / "model.safetensors").is_file()


def read_trainer_state(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    with open(path / "trainer_state.json") as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: unknown checkpoint format {state.get('format')!r}, want {FORMAT}"
        )
    return state


# ---------------------------------------------------------------------------------------------
# A run's checkpoints directory


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def list_step_checkpoints(root: Path) -> list[Path]:
    """Complete step checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and not p.is_symlink()]
    return sorted(
        (p for p in found if is_complete(p)), key=lambda p: int(p.name[len(STEP_PREFIX) :])
    )


def find_latest(root: Path) -> Path | None:
    steps = list_step_checkpoints(root)
    return steps[-1] if steps else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint dir -> itself; a run dir or checkpoints root -> final/, else the latest step."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path / "checkpoints", path):
        if is_complete(root / "final"):
            return root / "final"
        latest = find_latest(root)
        if latest is not None:
            return latest
    raise CheckpointError(
        f"no complete checkpoint at {path} (looked for final/ and step_*/ with {MARKER})"
    )


def set_best(root: Path, target: Path) -> None:
    """Point ``root/best`` at ``target`` by an atomic symlink swap."""
    link = Path(root) / "best"
    tmp = Path(root) / f"{TMP_PREFIX}best.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(Path(target).name, tmp)
    os.replace(tmp, link)


def best_target(root: Path) -> Path | None:
    link = Path(root) / "best"
    if not link.is_symlink():
        return None
    target = link.parent / os.readlink(link)
    return target if is_complete(target) else None


def prune_step_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` step checkpoints; the best one is kept."""
    best = best_target(root)
    steps = list_step_checkpoints(root)
    doomed = [
        p for p in steps[: max(0, len(steps) - keep_last)] if best is None or p.name != best.name
    ]
    for p in doomed:
        # Rename first so a crash mid-delete leaves a tmp dir, not a half checkpoint with a marker.
        trash = p.parent / f"{TMP_PREFIX}del-{p.name}"
        os.replace(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
    # Leftovers of crashed writes are never loaded; clean them up here.
    for leftover in Path(root).glob(f"{TMP_PREFIX}*"):
        if leftover.is_dir() and not leftover.name.endswith(f".{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
    return doomed
