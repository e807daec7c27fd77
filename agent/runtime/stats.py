"""What a serving process says about itself, for the daemon's telemetry and the governor.

Each process serving a model (an application's :class:`ActiveModel`, ``agentctl serve``)
rewrites one small JSON file about once a second::

    <state_dir>/runtime/<model>.<pid>.json

A file per process, so two applications serving one model never write the same file, and a
reader takes them all (the worst p99 is the one training must yield to). Files are written
atomically (temp + fsync + rename); a reader ignores one older than ``max_age_s`` (its process
died or stopped serving) and one that does not validate. The daemon's telemetry sums the
counts; the governor's latency loop reads the p99 against the application's SLO.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from registry.atomic import write_bytes_atomic

RUNTIME_DIR = "runtime"
MAX_STATS_BYTES = 64 * 1024
"""A stats file is a few hundred bytes; a reader refuses a larger one unread."""


class ServingStats(BaseModel):
    """One serving process's figures; latency over the last ``window_s`` seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    version: str | None
    """The version it serves now (None: no committed model yet)."""
    pid: int = Field(gt=0)
    updated: float
    """time.time() at writing."""
    window_s: float = Field(gt=0)
    window_requests: int = Field(ge=0)
    p50_ms: float | None = Field(default=None, ge=0)
    p99_ms: float | None = Field(default=None, ge=0)
    """Latency percentiles over the window (None: no request in it)."""
    requests: int = Field(ge=0)
    """Since the process started serving."""
    failed: int = Field(ge=0)
    swaps: int = Field(default=0, ge=0)
    """Versions switched to since it started."""
    slo_ms: float | None = Field(default=None, gt=0)
    """The application's p99 objective, where it states one."""


def stats_dir(state_dir: Path) -> Path:
    return state_dir / RUNTIME_DIR


def stats_path(state_dir: Path, model: str, pid: int | None = None) -> Path:
    return stats_dir(state_dir) / f"{model}.{pid if pid is not None else os.getpid()}.json"


def write_stats(state_dir: Path, stats: ServingStats) -> None:
    stats_dir(state_dir).mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(stats_path(state_dir, stats.model, stats.pid),
                       stats.model_dump_json().encode())


def read_stats(state_dir: Path, model: str | None = None, *, max_age_s: float = 5.0,
               now: float | None = None) -> list[ServingStats]:
    """Every fresh, valid stats file (of ``model``, or of every model)."""
    folder = stats_dir(state_dir)
    if not folder.is_dir():
        return []
    now = time.time() if now is None else now
    out = []
    for path in sorted(folder.glob(f"{model}.*.json" if model else "*.json")):
        try:
            if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_STATS_BYTES:
                continue
            stats = ServingStats.model_validate_json(path.read_bytes())
        except (OSError, ValidationError):
            continue
        if now - stats.updated <= max_age_s and (model is None or stats.model == model):
            out.append(stats)
    return out


def worst_p99(stats: list[ServingStats]) -> ServingStats | None:
    """The process whose p99 is furthest over its SLO (or the highest p99 where none has an
    SLO); None when no process served a request in its window."""
    served = [s for s in stats if s.p99_ms is not None]
    if not served:
        return None
    return max(served, key=lambda s: (s.p99_ms or 0.0) / (s.slo_ms or 1.0)
               if any(x.slo_ms for x in served) else (s.p99_ms or 0.0))


def remove_stats(state_dir: Path, model: str, pid: int | None = None) -> None:
    """Drop this process's file when it stops serving: readers need not wait ``max_age_s``
    to stop counting it."""
    stats_path(state_dir, model, pid).unlink(missing_ok=True)
