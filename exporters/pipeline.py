"""One export job: prune -> recover -> export -> quantize -> gate, with automatic fallback.

Steps, in order, each gated on the artefact it produced:

1. ``int8``: the whole model in Q/DQ INT8, with the recipe the target and host call for
   (``exporters.int8_recipe``);
1b. ``int8-s8s8``: only when step 1 used the fast ``u8s8-reduce-range`` recipe that an
   x86 host without VNNI gets by default: the whole model again in symmetric int8, which that
   host runs on its slower exact kernel; weights in [-64, 64] cost some models a few points
   (small_cnn at 32 px: 3.1 against 0.6), and this step wins them back before any layer is
   left in float;
2. ``int8-exclude-<k>``: the k layers most sensitive to quantization left in float,
   k = 1 .. ``fallback.max_excluded_layers`` (sensitivity measured per layer: quantize that
   layer alone, compare logits with FP32 on calibration data);
3. ``fp16``; 4. ``fp32``.

The first step that meets every gate wins and is installed into the output folder
(``model.onnx``, and ``model.engine`` + ``model.engine.json`` for TensorRT); the report says
which step won and why the earlier ones did not. Nothing is installed when no step passes.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils.data import Dataset

from exporters.calibration import representative_inputs
from exporters.cpu_isa import detect_isa
from exporters.flops import count_flops
from exporters.gates import GateResult, judge, measure
from exporters.int8_recipe import Int8Recipe, choose_recipe
from exporters.job import ExportJob, Precision
from exporters.onnx_export import OnnxExport, export_onnx
from exporters.onnx_weights import check_semi_structured
from exporters.ort_runner import OrtRunner
from exporters.prune import PruneResult, prune_model
from exporters.qdq_check import check_qdq
from exporters.quantize import prepare_for_quantization, quantizable_nodes, quantize_int8
from exporters.recovery import recover
from exporters.report import (
    Attempt,
    ExportReport,
    artefact_info,
    fallback_note,
    versions,
    write_report,
)
from exporters.runtime import Runner, TorchRunner, predict
from exporters.tensorrt_build import (
    TensorRTRunner,
    build_engine,
    require_tensorrt,
)
from hpc_core.atomic import atomic_output, write_json_atomic
from hpc_core.checkpoint import load_model, resolve_checkpoint
from hpc_core.config import DataConfig, TrainConfig
from hpc_core.data import build_datasets, held_out

INSTALLED = ("model.onnx", "model.onnx.json", "model.engine", "model.engine.json", "report.json")


@dataclass
class Source:
    model: nn.Module
    config: TrainConfig
    checkpoint: Path
    train: Dataset
    val: Dataset
    input_shape: tuple[int, int, int]


def load_source(job: ExportJob) -> Source:
    """The checkpoint's model (safetensors, never unpickled) and the job's data splits."""
    ckpt_dir = resolve_checkpoint(job.checkpoint)
    model, cfg = load_model(ckpt_dir, "cpu")
    m = cfg.model
    data = cfg.data.model_dump()
    if job.data is not None:  # the fields the job sets override the checkpoint's
        data.update(job.data.model_dump(include=job.data.model_fields_set))
    data = DataConfig.model_validate({**data, "image_size": m.image_size})
    train, val, info = build_datasets(data)
    if info.in_channels != m.in_channels:
        raise ValueError(
            f"data has {info.in_channels} channel(s) but the model takes {m.in_channels}: "
            "fix data.grayscale or use the model's data"
        )
    if info.num_classes > (m.num_classes or 0):
        raise ValueError(
            f"data has {info.num_classes} classes but the model predicts {m.num_classes}"
        )
    cfg = cfg.model_copy(update={"data": data})
    shape = (int(m.in_channels or 1), int(m.image_size or 1), int(m.image_size or 1))
    return Source(model.eval(), cfg, ckpt_dir, train, val, shape)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class _Run:
    """State shared by the attempts of one job."""

    job: ExportJob
    work: Path
    fp32: OnnxExport
    train: Dataset
    input_shape: tuple[int, int, int]
    inputs: np.ndarray
    labels: np.ndarray
    reference_logits: np.ndarray
    fidelity_logits: np.ndarray
    sparse: bool
    recipe: Int8Recipe
    """The first INT8 step's recipe."""
    calib: np.ndarray | None = None
    prepared: Path | None = None
    sensitivity: list[tuple[str, float]] | None = None
    notes: list[str] = field(default_factory=list)
    """Why planned steps were skipped; ends up in the report's fallback_reason."""

    @property
    def exact_recipe(self) -> Int8Recipe:
        """The recipe of the INT8 fallback steps: symmetric int8, exact on every host."""
        if self.recipe.activations_signed:
            return self.recipe
        return Int8Recipe("s8s8-symmetric", "fallback: u8s8-reduce-range missed its gates")

    def cache(self, recipe: Int8Recipe) -> Path:
        return self.work / f"calibration_ranges.{recipe.name}.json"

    def calibration_inputs(self) -> np.ndarray:
        if self.calib is None:
            c = self.job.calibration
            self.calib = representative_inputs(self.train, c.samples, c.seed)
        return self.calib

    def prepared_fp32(self) -> Path:
        if self.prepared is None:
            self.prepared = prepare_for_quantization(self.fp32.path, self.work / "fp32.prep.onnx")
        return self.prepared

    def quantize(
        self, out: Path, recipe: Int8Recipe, exclude: Sequence[str] = (),
        only: Sequence[str] | None = None,
    ) -> Path:
        """Quantize the FP32 model; the ranges of the first call are reused where possible."""
        quantize_int8(
            self.prepared_fp32(),
            out,
            calib_inputs=self.calibration_inputs(),
            input_name=self.fp32.input_name,
            cfg=self.job.calibration,
            recipe=recipe,
            cache_path=self.cache(recipe),
            nodes_to_exclude=exclude,
            nodes_to_quantize=only,
        )
        return out

    def layer_sensitivity(self) -> list[tuple[str, float]]:
        """Layers ranked by the logit MSE when only that layer is quantized, worst first."""
        if self.sensitivity is None:
            prepared = self.prepared_fp32()
            x = self.calibration_inputs()[: self.job.fallback.sensitivity_samples]
            # Scored in the job's batch: a device job sets it inside its memory budget.
            ref = predict(OrtRunner(prepared), x, batch=self.job.gates.batch_size)
            scores = []
            for node in quantizable_nodes(prepared):
                path = self.quantize(self.work / "sensitivity.onnx", self.exact_recipe,
                                     only=[node])
                out = predict(OrtRunner(path), x, batch=self.job.gates.batch_size)
                scores.append((node, float(np.mean((out - ref) ** 2))))
            self.sensitivity = sorted(scores, key=lambda s: -s[1])
        return self.sensitivity


Step = tuple[str, Precision, int, Int8Recipe | None]
"""(step name, precision, layers excluded, INT8 recipe)"""


def plan_steps(job: ExportJob, run: _Run) -> Iterator[Step]:
    """The steps in fallback order; exclusions are planned only once plain INT8 has failed
    (ranking layers costs one quantization per layer)."""
    order: list[Precision] = ["int8", "fp16", "fp32"]
    first = order.index(job.precision)
    fb = job.fallback
    for precision in order[first:]:
        if precision != job.precision and not fb.enabled:
            return
        if precision == "int8":
            yield "int8", "int8", 0, run.recipe
            exact = run.exact_recipe
            if fb.enabled and exact != run.recipe:
                yield "int8-s8s8", "int8", 0, exact
            if fb.enabled and fb.max_excluded_layers:
                try:
                    n = len(run.layer_sensitivity())
                except Exception as e:  # no ranking, no exclusion steps: go on to fp16
                    run.notes.append(f"layer sensitivity failed ({type(e).__name__}: {e}): "
                                     "exclusion steps skipped")
                    n = 0
                for k in range(1, min(fb.max_excluded_layers, n - 1) + 1):
                    yield f"int8-exclude-{k}", "int8", k, exact
        elif precision == "fp16" and (precision == job.precision or fb.fp16):
            yield "fp16", "fp16", 0, None
        elif precision == "fp32" and (precision == job.precision or fb.fp32):
            yield "fp32", "fp32", 0, None


def _fp16_onnx(fp32: Path, out: Path) -> Path:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # keep_io_types: callers keep feeding float32 and reading float32 logits.
    model = convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True)
    with atomic_output(out) as tmp:
        onnx.save(model, str(tmp))
    return out


def _make_artefact(
    run: _Run, step: str, precision: Precision, exclude: list[str], recipe: Int8Recipe | None
) -> tuple[Path, Path, list[str]]:
    """(ONNX file, served artefact, Q/DQ violations) of one step."""
    violations: list[str] = []
    if precision == "int8":
        assert recipe is not None
        onnx_path = run.quantize(run.work / f"{step}.onnx", recipe, exclude)
        violations = [str(v) for v in check_qdq(
            onnx_path, activations_signed=recipe.activations_signed)]
    elif precision == "fp16" and run.job.target == "onnxruntime":
        onnx_path = _fp16_onnx(run.fp32.path, run.work / "fp16.onnx")
    else:
        onnx_path = run.fp32.path
    if run.job.target == "onnxruntime":
        return onnx_path, onnx_path, violations
    engine = run.work / f"{step}.engine"
    build_engine(
        onnx_path, engine, precision=precision, sparse_weights=run.sparse,
        input_shape=run.input_shape, cfg=run.job.tensorrt,
    )
    return onnx_path, engine, violations


def _gate(run: _Run, artefact: Path) -> GateResult:
    g = run.job.gates
    runner: Runner = (
        OrtRunner(artefact, threads=g.threads)
        if run.job.target == "onnxruntime"
        else TensorRTRunner(artefact)
    )
    m = measure(
        runner,
        inputs=run.inputs,
        labels=run.labels,
        reference_logits=run.reference_logits,
        fidelity_logits=run.fidelity_logits,
        size_bytes=artefact.stat().st_size,
        cfg=g,
    )
    return judge(m, g)


def _install(src: Path, dest: Path) -> None:
    with atomic_output(dest) as tmp:
        shutil.copyfile(src, tmp)


def _prune(job: ExportJob, src: Source, model: nn.Module, report: ExportReport) -> bool:
    """Prune and recover ``model`` in place; True when its weights are 2:4."""
    assert job.prune is not None
    example = torch.zeros(1, *src.input_shape)
    result: PruneResult = prune_model(model, job.prune, example)
    report.prune = {
        "spec": job.prune.label,
        "sparsity": result.total_sparsity,
        "layers": [vars(s) for s in result.layers],
    }
    if "channels" in result.extra:
        ch = result.extra["channels"]
        report.prune["channels"] = {k: list(v) for k, v in ch.layers.items()}
        report.prune["channels_kept_whole"] = ch.skipped
    if job.recovery.steps > 0:
        rec = recover(
            model, result.masks, (src.train, src.val), src.config, job.recovery,
            job.out_dir / "work" / "recovery",
        )
        report.recovery = {"steps": rec.steps, "metrics": rec.metrics, "seconds": rec.seconds}
    return job.prune.method == "semi_structured"


def _model_summary(model: nn.Module, shape: tuple[int, ...]) -> dict[str, int]:
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "flops": count_flops(model, shape).total,
    }


def run_export(job: ExportJob) -> ExportReport:
    """Run ``job``; the report is also written to ``<out_dir>/report.json``."""
    t0 = time.perf_counter()
    if job.target == "tensorrt":
        require_tensorrt()  # fail before minutes of pruning and calibration
    out, work = job.out_dir, job.out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    for name in INSTALLED:  # a stale artefact must never pass for this job's result
        (out / name).unlink(missing_ok=True)
    report = ExportReport(target=job.target, job=job.model_dump(mode="json"), versions=versions())
    src = load_source(job)
    report.checkpoint = str(src.checkpoint)
    inputs, labels = held_out(src.val, job.gates.eval_samples)
    batch = job.gates.batch_size  # every scoring pass: the job's batch, never more
    reference_logits = predict(TorchRunner(src.model), inputs, batch=batch)
    before = _model_summary(src.model, src.input_shape)
    model = copy.deepcopy(src.model)
    sparse = _prune(job, src, model, report) if job.prune is not None else False
    after = _model_summary(model, src.input_shape)
    report.model = {
        "name": src.config.model.name,
        "kwargs": src.config.model.kwargs,
        "input_shape": list(src.input_shape),
        "num_classes": src.config.model.num_classes,
        "params_before": before["params"],
        "params_after": after["params"],
        "flops_before": before["flops"],
        "flops_after": after["flops"],
    }
    fidelity_logits = predict(TorchRunner(model), inputs, batch=batch)
    fp32 = export_onnx(model, out / "model.fp32.onnx", src.input_shape, job.onnx)
    report.onnx = {
        "opset": fp32.opset,
        "exporter": job.onnx.exporter,
        "simplified_by": fp32.simplified_by,
        "fp32_size_bytes": fp32.size_bytes,
    }
    if sparse:
        checks = check_semi_structured(fp32.path)
        eligible = [c for c in checks if c.eligible]
        bad = [c.node for c in eligible if c.violations]
        report.semi_structured = {
            "layers_2_4": len(eligible) - len(bad),
            "eligible_layers": len(eligible),
            "not_2_4": bad,
        }
        if bad or not eligible:
            raise RuntimeError(f"exported weights are not 2:4 in {bad or 'any layer'}")
    isa = detect_isa()
    recipe = choose_recipe(job.target, isa, job.int8_recipe)
    if job.precision == "int8":
        report.int8 = {"recipe": recipe.name, "reason": recipe.reason, "isa": isa.to_dict()}
    run = _Run(job, work, fp32, src.train, src.input_shape, inputs, labels, reference_logits,
               fidelity_logits, sparse, recipe)
    _run_attempts(run, report)
    report.fallback = fallback_note(report)
    if report.sensitivity is None and run.sensitivity is not None:
        report.sensitivity = [{"node": n, "logit_mse": s} for n, s in run.sensitivity]
    if not job.keep_intermediates:
        shutil.rmtree(work, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    write_report(report, out / "report.json")
    return report


def _run_attempts(run: _Run, report: ExportReport) -> None:
    job = run.job
    rejected: list[str] = []
    for step, precision, k, recipe in plan_steps(job, run):
        t = time.perf_counter()
        exclude = [n for n, _ in run.layer_sensitivity()[:k]] if k else []
        attempt = Attempt(step=step, precision=precision, excluded=exclude,
                          recipe=recipe.name if recipe else None)
        report.attempts.append(attempt)
        try:
            onnx_path, artefact, violations = _make_artefact(
                run, step, precision, exclude, recipe)
        except Exception as e:  # one step failing to build is what the next step is for
            attempt.error = f"{type(e).__name__}: {e}"
            attempt.seconds = time.perf_counter() - t
            rejected.append(f"{step}: {attempt.error}")
            continue
        attempt.artefact = artefact.name
        attempt.qdq_violations = violations
        result = _gate(run, artefact)
        attempt.measurement = result.measurement
        attempt.failures = result.failures + [f"Q/DQ structure: {v}" for v in violations]
        attempt.passed = not attempt.failures
        attempt.seconds = time.perf_counter() - t
        if not attempt.passed:
            rejected.append(f"{step}: {'; '.join(attempt.failures)}")
            continue
        dest = job.out_dir / "model.onnx"
        _install(onnx_path, dest)
        report.artefact = dest.name
        # What the file is and how it was made travels with it (into the slot, signed).
        write_json_atomic(dest.with_name("model.onnx.json"),
                          artefact_info(report, attempt, _sha256(dest)))
        if job.target == "tensorrt":
            engine = job.out_dir / "model.engine"
            _install(artefact, engine)
            meta = artefact.with_name(artefact.name + ".json")
            _install(meta, engine.with_name("model.engine.json"))
            report.artefact = engine.name
        report.status, report.winner = "passed", step
        report.artefact_sha256 = _sha256(job.out_dir / report.artefact)
        break
    rejected += run.notes
    if rejected:
        report.fallback_reason = " | ".join(rejected)
