"""What this device's memory probes measured, kept so that a micro-batch forced beside a budget
is checked when the job is submitted.

The probes that decide whether a micro-batch fits need torch and the model (the fine-tune step
runs them, ``agent.finetune.memory_plan``); submission is torch-free (the daemon, the CLI's
preflight). So every plan leaves its fit — fixed MB, MB per sample, the noise margin and the job
process's own MB — under ``STATE/cache/memory_fits.json``, keyed by what the peak depends on:
the weights the fine-tune starts from (their signed manifest), the data (path, size, change
time), the knobs that change memory (trainable scope, activation checkpointing, precision,
device, profile, optimizer, held-out share) and the torch and Python in use. A job submitted
with the same key and a forced micro-batch is refused at once with the numbers
(:func:`submitted_refusal`); with no fit on record, the fine-tune step probes and refuses it
before anything trains. One rule for both: :func:`largest_micro_batch`.

Torch-free: the daemon imports it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from registry.atomic import write_json_atomic

FITS = Path("cache") / "memory_fits.json"
"""Under the state dir."""
ENTRIES = 32
MEMORY_KNOBS = ("trainable", "activation_checkpointing", "precision", "device", "profile",
                "optimizer", "val_fraction")
"""The fine-tune fields that change a step's peak; the rest (lr, steps, seed...) do not."""


@dataclass(frozen=True)
class MemoryFit:
    """``peak = job_process_mb + max(startup_mb, base_mb + per_sample_mb * m)``, within
    ``margin_mb``.

    ``startup_mb`` is the fine-tune process's peak before its first step (imports, the model
    loaded, its cold library pages not yet dropped: ``agent.finetune.cold_pages``); the line
    is fitted to the training step's own peaks. Fitted to whole-process peaks instead, a
    start-up peak above the small probes' steps flattens the line (309, 309, 310 MB at 4, 8,
    16 samples) and the plan lands on a size whose step goes far past it (459 MB at 64).
    """

    base_mb: float
    per_sample_mb: float
    margin_mb: float
    job_process_mb: float
    startup_mb: float = 0.0

    def peak_mb(self, micro: int) -> float:
        return self.job_process_mb + max(self.startup_mb,
                                         self.base_mb + self.per_sample_mb * micro)


def largest_micro_batch(fit: MemoryFit, budget_mb: float, over: Collection[int] = ()) -> int:
    """The largest micro-batch whose predicted whole-tree peak plus the noise margin stays
    within ``budget_mb``, below every size in ``over`` (a probe that went past it); 0 when
    not even one sample fits (or the start-up alone does not)."""
    if fit.job_process_mb + fit.startup_mb + fit.margin_mb > budget_mb:
        return 0
    micro = int((budget_mb - fit.job_process_mb - fit.margin_mb - fit.base_mb)
                // fit.per_sample_mb)
    if over:
        micro = min(micro, min(over) - 1)
    return max(micro, 0)


def forced_refusal(micro: int, budget_mb: float, fit: MemoryFit,
                   over: Collection[int] = ()) -> str | None:
    """Why ``finetune.micro_batch=micro`` cannot run within ``budget_mb``, or None."""
    largest = largest_micro_batch(fit, budget_mb, over)
    if micro <= largest:
        return None
    past = [m for m in over if m <= micro]
    probed = (f", but the probe at micro-batch {min(past)} went past the budget or did not "
              "finish" if past and fit.peak_mb(micro) + fit.margin_mb <= budget_mb else "")
    return (f"finetune.micro_batch={micro} does not fit finetune.budget_mb={budget_mb:.0f}: "
            f"the probes predict a whole-tree peak of ~{fit.peak_mb(micro):.0f} MB "
            f"(+{fit.margin_mb:.0f} MB noise margin){probed}; the largest micro-batch that "
            f"fits is {largest}: drop micro_batch to let the planner choose, or raise the budget")


def fit_key(model: str, weights: Path, data: Path, finetune: Mapping[str, Any]) -> str | None:
    """What a fine-tune's peak depends on, known before it starts: ``weights`` is the folder
    holding the start version's signed ``manifest.json``. None when it cannot be known (no
    manifest; data that changes while it is read, a spool)."""
    try:
        manifest = hashlib.sha256((weights / "manifest.json").read_bytes()).hexdigest()
        data_id = _data_identity(data)
    except OSError:
        return None
    if data_id is None:
        return None
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "?"
    knobs = {k: finetune.get(k) for k in MEMORY_KNOBS}
    blob = json.dumps([model, manifest, data_id, knobs, torch_version, sys.version],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _data_identity(data: Path) -> list[Any] | None:
    from agent.spool.config import is_spool

    real = data.resolve(strict=True)
    if is_spool(real):
        return None  # it records while jobs run: its snapshot differs every job
    if real.is_file():
        st = real.stat()
        return [str(real), st.st_size, st.st_mtime_ns]
    files = [p.stat() for p in sorted(real.rglob("*")) if p.is_file()]
    return [str(real), len(files), sum(s.st_size for s in files),
            max((s.st_mtime_ns for s in files), default=0)]


def record_fit(state_dir: Path, key: str | None, fit: MemoryFit) -> None:
    """Keep ``fit`` for ``key`` (the newest ``ENTRIES`` keys), atomically."""
    if key is None:
        return
    fits = _read(state_dir)
    fits[key] = {**asdict(fit), "recorded_at": time.time()}
    # The file is written with sorted keys: the newest are found by their time, not order.
    newest = sorted(fits, key=lambda k: _when(fits[k]))[-ENTRIES:]
    path = Path(state_dir) / FITS
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {k: fits[k] for k in newest})


def _when(entry: Any) -> float:
    at = entry.get("recorded_at") if isinstance(entry, dict) else None
    return float(at) if isinstance(at, (int, float)) else 0.0


def recorded_fit(state_dir: Path, key: str | None) -> MemoryFit | None:
    entry = _read(state_dir).get(key) if key is not None else None
    if entry is None:
        return None
    try:
        return MemoryFit(**{k: float(entry[k]) for k in
                            ("base_mb", "per_sample_mb", "margin_mb", "job_process_mb")},
                         startup_mb=float(entry.get("startup_mb", 0.0)))
    except (KeyError, TypeError, ValueError):
        return None  # a damaged entry: the fine-tune step probes again


def _read(state_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(state_dir) / FITS).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: nothing is checked at submission
    return data if isinstance(data, dict) else {}


def submitted_refusal(state_dir: Path, model: str, version: str | None, data: Path,
                      finetune: Mapping[str, Any]) -> str | None:
    """At submission: why the job's forced micro-batch cannot fit its explicit budget, from
    the fit this device recorded for the same weights, data and knobs; None when it fits, when
    nothing is forced or budgeted, or when no fit is on record (the fine-tune step checks)."""
    micro, budget = finetune.get("micro_batch"), finetune.get("budget_mb")
    if micro is None or budget is None:
        return None
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    try:
        slots = ModelSlots(state_dir, model)
        start = slots.installed(version) if version else slots.active()
    except (RegistryError, OSError):
        return None  # not on the device yet: the pull fetches it, the step checks
    if start is None:
        return None
    fit = recorded_fit(state_dir, fit_key(model, start.path, data, finetune))
    if fit is None:
        return None
    why = forced_refusal(int(micro), float(budget), fit)
    return None if why is None else why + " (from this device's last probes of this job)"
