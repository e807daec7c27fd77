"""Shared test set-up: keep torch to few threads so tests run side by side on 2 cores."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for a child Python that imports the project from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    for k in list(env):
        if k.startswith("HPC_FAULT_"):
            del env[k]
    return env


@pytest.fixture
def python() -> str:
    return sys.executable
