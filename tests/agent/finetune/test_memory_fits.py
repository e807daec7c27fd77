"""The fits a device's memory probes leave for submission-time checks: one rule for what
fits (the planner's and the forced micro-batch's), keys that change with anything the peak
depends on, and a damaged or missing record that checks nothing rather than failing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from agent.finetune.memory_fits import (
    ENTRIES,
    FITS,
    MemoryFit,
    fit_key,
    forced_refusal,
    largest_micro_batch,
    record_fit,
    recorded_fit,
)
from agent.finetune.memory_plan import fit_plan

FIT = MemoryFit(base_mb=270.0, per_sample_mb=0.5, margin_mb=4.0, job_process_mb=60.0)
KNOBS = {"trainable": "all", "activation_checkpointing": False, "precision": "auto",
         "device": "auto", "profile": "generic-x86", "optimizer": "adamw", "val_fraction": 0.3,
         "lr": 1e-3, "micro_batch": 64, "budget_mb": 450.0}


def test_the_largest_micro_batch_is_where_the_line_plus_margin_meets_the_budget() -> None:
    # 450 - 60 - 4 - 270 = 116 MB for samples at 0.5 MB each.
    assert largest_micro_batch(FIT, 450) == 232
    assert forced_refusal(232, 450, FIT) is None
    why = forced_refusal(233, 450, FIT)
    assert why is not None and "finetune.micro_batch=233 does not fit finetune.budget_mb=450" in why
    assert "~446 MB (+4 MB noise margin)" in why
    assert "the largest micro-batch that fits is 232" in why
    assert largest_micro_batch(FIT, 450, over=[100]) == 99  # a probe past the budget is a fact
    assert largest_micro_batch(FIT, 300) == 0


def test_the_start_up_peak_binds_small_micro_batches_and_the_line_large_ones() -> None:
    fit = MemoryFit(base_mb=250.0, per_sample_mb=2.0, margin_mb=4.0, job_process_mb=60.0,
                    startup_mb=310.0)
    assert fit.peak_mb(1) == 60 + 310 and fit.peak_mb(40) == 60 + 330
    assert largest_micro_batch(fit, 450) == 68  # (450 - 60 - 4 - 250) / 2
    assert largest_micro_batch(fit, 373) == 0  # 60 + 310 + 4 > 373: not even the start-up fits
    assert largest_micro_batch(fit, 374) == 30  # the start-up fits; the line allows 30


def test_a_forced_micro_batch_is_judged_by_the_line_not_by_the_planners_divisor() -> None:
    """The planner prefers a divisor of the effective batch (every micro-step the same shape);
    a forced micro-batch that fits must not be refused because the plan chose a divisor."""
    points = {4: [272.0, 272.0], 8: [274.0, 274.0], 16: [278.0, 278.0]}
    plan = fit_plan(450, 256, points, "test", job_process_mb=60)
    assert plan.micro_batch_size == 128  # the line allows 240, the planner takes a divisor
    line = plan.line()
    assert forced_refusal(200, 450, line) is None
    assert forced_refusal(241, 450, line) is not None


def _start(tmp_path: Path, manifest: bytes = b'{"version": "v1"}') -> Path:
    weights = tmp_path / "slot"
    weights.mkdir(parents=True, exist_ok=True)
    (weights / "manifest.json").write_bytes(manifest)
    return weights


def test_keys_change_with_what_the_peak_depends_on_and_only_that(tmp_path: Path) -> None:
    weights = _start(tmp_path)
    data = tmp_path / "device.npz"
    np.savez(data, x=np.zeros((10, 1, 8, 8), np.float32), y=np.zeros(10, np.int64))
    key = fit_key("digits", weights, data, KNOBS)
    assert key is not None and key == fit_key("digits", weights, data, dict(KNOBS))
    # lr, the budget and the micro-batch do not move a peak's line
    assert fit_key("digits", weights, data, {**KNOBS, "lr": 0.1, "micro_batch": 8,
                                              "budget_mb": 900}) == key
    assert fit_key("other", weights, data, KNOBS) != key
    assert fit_key("digits", weights, data, {**KNOBS, "trainable": "head"}) != key
    assert fit_key("digits", weights, data, {**KNOBS, "activation_checkpointing": True}) != key
    assert fit_key("digits", _start(tmp_path / "b", b'{"version": "v2"}'), data, KNOBS) != key
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # new data, same name
    assert fit_key("digits", weights, data, KNOBS) != key
    folder = tmp_path / "images"
    (folder / "cls0").mkdir(parents=True)
    (folder / "cls0" / "a.png").write_bytes(b"x")
    before = fit_key("digits", weights, folder, KNOBS)
    (folder / "cls0" / "b.png").write_bytes(b"y")
    assert before is not None and fit_key("digits", weights, folder, KNOBS) != before
    # Nothing to key on: no signed manifest, data that is not there, a spool (it records
    # while jobs run)
    assert fit_key("digits", tmp_path / "nowhere", data, KNOBS) is None
    assert fit_key("digits", weights, tmp_path / "missing.npz", KNOBS) is None
    spool = tmp_path / "spool"
    spool.mkdir()
    from agent.spool.config import MARKER

    (spool / MARKER).write_text("{}")
    assert fit_key("digits", weights, spool, KNOBS) is None


def test_records_are_bounded_and_a_damaged_file_checks_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert recorded_fit(state, "k") is None  # no file yet
    record_fit(state, None, FIT)  # an unknown key is not recorded
    assert not (state / FITS).exists()
    for i in range(ENTRIES + 5):
        record_fit(state, f"k{i}", FIT)
    kept = json.loads((state / FITS).read_text())
    assert len(kept) == ENTRIES and "k0" not in kept and f"k{ENTRIES + 4}" in kept
    assert recorded_fit(state, f"k{ENTRIES + 4}") == FIT
    record_fit(state, "k5", MemoryFit(1, 2, 3, 4, 5))  # re-recorded: the newest, kept longest
    record_fit(state, "k99", FIT)
    kept = json.loads((state / FITS).read_text())
    assert "k5" in kept and "k6" not in kept
    assert recorded_fit(state, "k5") == MemoryFit(1, 2, 3, 4, 5)
    (state / FITS).write_text('{"k5": {"base_mb": "x"}}')
    assert recorded_fit(state, "k5") is None
    (state / FITS).write_text("not json")
    assert recorded_fit(state, "k5") is None
