from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest
from pydantic import ValidationError

from exporters import pipeline
from exporters.cpu_isa import detect_isa
from exporters.int8_recipe import choose_recipe
from exporters.job import ExportJob
from exporters.onnx_weights import check_semi_structured, weight_refs
from exporters.pipeline import run_export
from exporters.prepare import load_source
from exporters.qdq_check import check_qdq

REPO = Path(__file__).resolve().parents[2]
FAST_GATES = {"latency_iters": 3, "latency_warmup": 1, "batch_size": 8}


def _job(trained: Any, out: Path, **fields: Any) -> ExportJob:
    gates = {**FAST_GATES, **fields.pop("gates", {})}
    return ExportJob(checkpoint=trained.checkpoint, out_dir=out, gates=gates, **fields)


def test_2_4_with_recovery_and_int8_stays_within_two_points(cnn: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The TensorRT recipe on any host, so the installed file can be held to TensorRT's rules.
    report = run_export(_job(cnn, out, prune="2:4", precision="int8", int8_recipe="s8s8-symmetric",
                             recovery={"steps": 80}, gates={"max_top1_drop_pts": 2.0}))
    assert report.status == "passed" and report.winner == "int8", report.fallback_reason
    m = report.attempts[0].measurement
    assert m is not None and m.top1_drop_pts <= 2.0
    # The reference is the model as trained, on its own validation split.
    assert m.reference_top1 == pytest.approx(cnn.val_acc)
    assert report.recovery is not None and report.recovery["steps"] == 80
    assert report.semi_structured == {"layers_2_4": 3, "eligible_layers": 3, "not_2_4": []}
    # The installed artefact itself: int8 Q/DQ, TensorRT-clean, weights still 2:4.
    installed = out / "model.onnx"
    assert check_qdq(installed) == []
    eligible = [c for c in check_semi_structured(installed) if c.eligible]
    assert len(eligible) == 3 and all(c.violations == 0 for c in eligible)
    assert all(c.sparsity >= 0.5 for c in eligible)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["winner"] == "int8" and on_disk["artefact_sha256"] == report.artefact_sha256
    assert not (out / "work").exists()


def test_an_impossible_gate_walks_the_fallback_chain(cnn: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast recipe first, then symmetric int8 (exact on every host), then layers left in
    float, FP16, FP32: the recipe is set so the chain is the same on every host."""
    sessions: list[tuple[str, bool, int]] = []

    class Recorded(pipeline.OrtRunner):
        def __init__(self, path: Path, **kw: Any) -> None:
            sessions.append((Path(path).name, kw.get("spin", True), kw.get("threads", 0)))
            super().__init__(path, **kw)

    monkeypatch.setattr(pipeline, "OrtRunner", Recorded)
    out = tmp_path / "out"
    report = run_export(_job(cnn, out, precision="int8", int8_recipe="u8s8-reduce-range",
                             gates={"max_abs_logit_delta": 1e-4}))
    steps = [a.step for a in report.attempts]
    assert steps == ["int8", "int8-s8s8", "int8-exclude-1", "int8-exclude-2", "int8-exclude-3",
                     "fp16", "fp32"]
    assert [a.recipe for a in report.attempts] == [
        "u8s8-reduce-range", *["s8s8-symmetric"] * 4, None, None]
    assert report.status == "passed" and report.winner == "fp32"
    assert [a.passed for a in report.attempts] == [False] * 6 + [True]
    assert all("gates.max_abs_logit_delta" in a.failures[0] for a in report.attempts[:6])
    assert report.fallback_reason is not None
    assert all(s in report.fallback_reason for s in steps[:6])
    # The one line people see says what plain INT8 measured and missed, and who won.
    first = report.attempts[0].measurement
    assert first is not None and report.fallback is not None
    assert report.fallback.startswith(
        f"int8 missed its gates at top-1 drop {first.top1_drop_pts:.2f} pts")
    assert "gates.max_abs_logit_delta" in report.fallback
    assert report.fallback.endswith("; fp32 won")
    # Exclusions follow the measured per-layer sensitivity, worst first.
    assert report.sensitivity is not None and len(report.sensitivity) == 4
    ranked = [s["node"] for s in report.sensitivity]
    for k, attempt in enumerate(report.attempts[2:5], start=1):
        assert attempt.excluded == ranked[:k]
    # The ranking (the float reference, then a session per layer for one pass each) scores
    # in the gates' threads (one by default), a pool's threads asleep between runs; the gates
    # time the model as ONNX Runtime runs it by default.
    ranking_files = ("fp32.prep.onnx", "sensitivity.onnx")
    ranking = [(spin, threads) for name, spin, threads in sessions if name in ranking_files]
    assert ranking == [(False, 1)] * (1 + 4), sessions
    assert len(sessions) == len(ranking) + len(report.attempts) and all(
        spin for name, spin, _ in sessions if name not in ranking_files)
    deltas = [a.measurement.max_abs_logit_delta for a in report.attempts if a.measurement]
    assert deltas[0] > deltas[5] > deltas[6]  # int8 > fp16 > fp32
    installed = onnx.load(str(out / "model.onnx"))
    assert not any(n.op_type == "QuantizeLinear" for n in installed.graph.node)
    assert json.loads((out / "report.json").read_text())["winner"] == "fp32"


def test_when_nothing_passes_nothing_is_installed(cnn: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"stale artefact of an earlier job")
    report = run_export(_job(cnn, out, precision="int8", fallback={"enabled": False},
                             gates={"max_p50_ms_b1": 1e-6}))
    assert report.status == "failed" and report.winner is None
    assert [a.step for a in report.attempts] == ["int8"]
    assert "gates.max_p50_ms_b1" in report.attempts[0].failures[0]
    assert not (out / "model.onnx").exists()
    assert json.loads((out / "report.json").read_text())["status"] == "failed"


def test_channel_pruned_job_is_smaller_and_passes(cnn: Any, tmp_path: Path) -> None:
    report = run_export(_job(cnn, tmp_path, prune="channels:0.5"))
    assert report.status == "passed" and report.winner == "fp32"
    assert report.model["flops_after"] <= 0.6 * report.model["flops_before"]
    assert report.prune is not None and report.prune["channels"]["features.1.0"] == [64, 32]
    gemm = next(r for r in weight_refs(tmp_path / "model.onnx") if r.op_type == "Gemm")
    assert gemm.array.shape == (10, 64)


def test_job_validation_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="calibraton"):
        ExportJob.model_validate({"checkpoint": tmp_path, "out_dir": tmp_path,
                                  "calibraton": {"samples": 10}})
    with pytest.raises(ValidationError, match="prune"):
        ExportJob(checkpoint=tmp_path, out_dir=tmp_path, prune="3:8")  # type: ignore[arg-type]
    job = ExportJob(checkpoint=tmp_path, out_dir=tmp_path, prune="channels:0.5")  # type: ignore[arg-type]
    assert job.prune is not None and job.prune.method == "channels"


def test_job_data_overrides_only_what_it_sets(cnn: Any, tmp_path: Path) -> None:
    job = ExportJob(checkpoint=cnn.checkpoint, out_dir=tmp_path,
                    data={"source": "digits", "split_seed": 1})
    src = load_source(job)
    assert src.config.data.image_size == 16  # the model's input size, not digits' native 8
    assert src.config.data.split_seed == 1
    assert src.input_shape == (1, 16, 16)


def test_int8_recipe_follows_the_host_unless_set(cnn: Any, tmp_path: Path) -> None:
    """auto: the host's recipe (u8s8-reduce-range on x86 without VNNI); a set recipe is kept
    and its structure checked; TensorRT refuses the u8s8 one before any work."""
    host = choose_recipe("onnxruntime", detect_isa())
    auto = run_export(_job(cnn, tmp_path / "auto", precision="int8"))
    assert auto.int8 is not None and auto.int8["recipe"] == host.name
    assert auto.int8["isa"] == detect_isa().to_dict()
    assert auto.winner == "int8" and auto.fallback is None, auto.fallback_reason
    for name in ("s8s8-symmetric", "u8s8-reduce-range"):
        report = run_export(_job(cnn, tmp_path / name, precision="int8", int8_recipe=name))
        assert report.winner == "int8", report.fallback_reason
        assert report.attempts[0].recipe == name
        assert report.int8 is not None and report.int8["recipe"] == name
        installed = tmp_path / name / "model.onnx"
        signed = name == "s8s8-symmetric"
        assert check_qdq(installed, activations_signed=signed) == []
        assert (check_qdq(installed) == []) == signed  # TensorRT's rules: s8s8 only
    with pytest.raises(ValidationError, match="int8_recipe=u8s8-reduce-range cannot build"):
        ExportJob(checkpoint=tmp_path, out_dir=tmp_path, target="tensorrt",
                  int8_recipe="u8s8-reduce-range")


def test_symmetric_int8_needs_no_recipe_step(cnn: Any, tmp_path: Path) -> None:
    """The s8s8 step exists to win back what weights in [-64, 64] cost; a job already on
    symmetric int8 (TensorRT, VNNI and ARM hosts) goes straight to excluding layers."""
    report = run_export(_job(cnn, tmp_path, precision="int8", int8_recipe="s8s8-symmetric",
                             gates={"max_abs_logit_delta": 1e-4},
                             fallback={"max_excluded_layers": 1, "fp16": False}))
    assert [a.step for a in report.attempts] == ["int8", "int8-exclude-1", "fp32"]


def test_the_quantizing_half_never_imports_torch() -> None:
    """A device job runs it in its own process so torch and ONNX Runtime are never resident
    together (the budget of the whole job); importing torch here would undo that."""
    code = ("import sys, exporters.pipeline, agent.jobs.steps.export; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
