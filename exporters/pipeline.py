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
3. ``int8-qat`` (``fallback.qat``): quantization-aware training, a short fake-quant
   fine-tune (``exporters.qat``, in a child process: torch), then the whole model in INT8
   again;
4. ``fp16``; 5. ``fp32``.

A detector's graph is its network (the core) followed by box decoding and NMS (the tail,
``exporters.detection.tail``): every step quantizes or converts the core alone and joins
the float tail to it afterwards, so no quantizer ever touches decoding or NMS; the layer
sensitivity is measured on the core's raw head (class logits and box regressions before
NMS). A TensorRT engine of a detector is built from the core with the ``EfficientNMS_TRT``
plugin as its tail.

The first step that meets every gate wins and is installed into the output folder
(``model.onnx``, and ``model.engine`` + ``model.engine.json`` for TensorRT); the report says
which step won and why the earlier ones did not. Nothing is installed when no step passes.

Two halves: ``exporters.prepare`` (torch: prune, recover, FP32 ONNX, reference logits) hands
over through ``exporters.handoff`` to :func:`quantize_and_gate` here, which never imports
torch. :func:`run_export` runs both in one process; a device job runs each in its own child
(``agent.jobs.steps.export``) so torch and ONNX Runtime are never resident together.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from exporters.cpu_isa import detect_isa
from exporters.detection.tail import NmsKind, TailSpec, attach
from exporters.gates import GateResult, judge, measure
from exporters.handoff import Prepared, read_prepared
from exporters.int8_recipe import Int8Recipe, choose_recipe
from exporters.job import ExportJob, Precision
from exporters.ort_runner import OrtRunner
from exporters.qdq_check import check_qdq
from exporters.quantize import prepare_for_quantization, quantizable_nodes, quantize_int8
from exporters.report import Attempt, ExportReport, artefact_info, fallback_note, write_report
from exporters.runtime import Runner, predict
from exporters.tensorrt_build import TensorRTRunner, build_engine
from registry.atomic import atomic_output, write_bytes_atomic, write_json_atomic


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
    src: Prepared
    recipe: Int8Recipe
    """The first INT8 step's recipe."""
    prepared: Path | None = None
    qat_prepared: Path | None = None
    """The QAT fine-tune's float core, prepared for quantization (after ``int8-qat`` ran)."""
    sensitivity: list[tuple[str, float]] | None = None
    notes: list[str] = field(default_factory=list)
    """Why planned steps were skipped; ends up in the report's fallback_reason."""
    qat: dict[str, object] | None = None
    """The QAT fine-tune's summary (steps, final metrics, seconds), once it ran."""
    qat_ranges: dict[str, float] = field(default_factory=dict)
    """The fine-tune's input range (max |x|) of each convolution, by the tensor's name in the
    prepared QAT core: the Q/DQ ranges its INT8 file takes instead of calibrated ones."""

    @property
    def exact_recipe(self) -> Int8Recipe:
        """The recipe of the INT8 fallback steps: symmetric int8, exact on every host."""
        if self.recipe.activations_signed:
            return self.recipe
        return Int8Recipe("s8s8-symmetric", "fallback: u8s8-reduce-range missed its gates")

    def cache(self, recipe: Int8Recipe, tag: str = "") -> Path:
        return self.work / f"calibration_ranges.{recipe.name}{tag}.json"

    def calibration_inputs(self) -> np.ndarray:
        return self.src.calib

    @property
    def float_core(self) -> Path:
        """The float graph INT8 quantizes: the whole model, or a detector's core."""
        return self.src.core_path or self.src.fp32_path

    def prepared_fp32(self) -> Path:
        if self.prepared is None:
            self.prepared = prepare_for_quantization(self.float_core,
                                                     self.work / "fp32.prep.onnx")
        return self.prepared

    def quantize(
        self, out: Path, recipe: Int8Recipe, exclude: Sequence[str] = (),
        only: Sequence[str] | None = None, qat: bool = False,
    ) -> Path:
        """Quantize the FP32 model (``qat``: the QAT fine-tune's); the ranges of the first
        call are reused where possible."""
        source = self.qat_prepared if qat else self.prepared_fp32()
        assert source is not None, "the QAT fine-tune has not run"
        quantize_int8(
            source,
            out,
            calib_inputs=self.calibration_inputs(),
            input_name=self.src.input_name,
            cfg=self.job.calibration,
            recipe=recipe,
            cache_path=self.cache(recipe, ".qat" if qat else ""),
            nodes_to_exclude=exclude,
            nodes_to_quantize=only,
            range_overrides=self.qat_ranges if qat else None,
        )
        return out

    @property
    def nms(self) -> NmsKind:
        return "efficient_nms_trt" if self.job.target == "tensorrt" else "onnx"

    def with_tail(self, core: Path, out: Path) -> Path:
        """``core`` as the served graph: with a detector's float tail joined to it, else
        itself."""
        if self.src.tail_path is None:
            return core
        return attach(core, TailSpec.load(self.src.tail_path), out, self.nms)

    def run_qat(self) -> dict[str, object]:
        """The QAT fine-tune (a child process: torch), once; its float core prepared, its
        activation ranges mapped onto that core's tensors."""
        out = self.work / "qat"
        out.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(out / "job.json", self.job.model_dump_json().encode())
        proc = subprocess.run([sys.executable, "-m", "exporters.qat", str(out / "job.json"),
                               str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the QAT fine-tune failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-1500:]}")
        result: dict[str, object] = json.loads((out / "qat.json").read_text())
        self.qat_prepared = prepare_for_quantization(Path(str(result["core"])),
                                                     self.work / "qat.prep.onnx")
        ranges = result.pop("activation_ranges")
        self.qat_ranges = conv_input_ranges(self.qat_prepared, ranges)  # type: ignore[arg-type]
        result["activation_ranges_set"] = len(self.qat_ranges)
        return result

    def layer_sensitivity(self) -> list[tuple[str, float]]:
        """Layers ranked by the logit MSE when only that layer is quantized, worst first."""
        if self.sensitivity is None:
            prepared = self.prepared_fp32()
            x = self.calibration_inputs()[: self.job.fallback.sensitivity_samples]
            # Scored as the gates score: in the job's batch (a device job sets it inside its
            # memory budget) and threads (one by default: the device may be fine-tuning or
            # serving). A session per layer, for one pass over ``x``: a pool's threads would
            # spin after each session's start and while Python quantizes the next layer, so
            # they sleep.
            g = self.job.gates

            def score(path: Path) -> np.ndarray:
                return predict(OrtRunner(path, threads=g.threads, spin=False), x,
                               batch=g.batch_size)

            ref = score(prepared)
            scores = []
            for node in quantizable_nodes(prepared):
                out = score(self.quantize(self.work / "sensitivity.onnx", self.exact_recipe,
                                          only=[node]))
                scores.append((node, float(np.mean((out - ref) ** 2))))
            self.sensitivity = sorted(scores, key=lambda s: -s[1])
        return self.sensitivity


QAT_STEP = "int8-qat"


def conv_input_ranges(model_path: Path, by_weight: dict[str, float]) -> dict[str, float]:
    """``by_weight`` (range by ``exporters.qat.weight_key``) as ranges of the Conv inputs of
    ``model_path``; a tensor two convolutions read takes the wider range."""
    model = onnx.load(str(model_path))
    inits = {i.name: i for i in model.graph.initializer}
    out: dict[str, float] = {}
    for n in model.graph.node:
        if n.op_type != "Conv" or len(n.input) < 2 or n.input[1] not in inits:
            continue
        w = np.ascontiguousarray(onnx.numpy_helper.to_array(inits[n.input[1]]), np.float32)
        r = by_weight.get(hashlib.sha1(w.tobytes()).hexdigest())
        if r is not None:
            out[n.input[0]] = max(r, out.get(n.input[0], 0.0))
    return out

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
            if fb.enabled and fb.qat:
                if job.prune is None:
                    yield QAT_STEP, "int8", 0, exact
                else:
                    run.notes.append(f"{QAT_STEP} skipped: a fine-tune would fill the pruned "
                                     "weights again")
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
    whole = run.work / f"{step}.onnx"
    if precision == "int8":
        assert recipe is not None
        qat = step == QAT_STEP
        if qat:
            run.qat = run.run_qat()
        core_name = f"{step}.core.onnx" if run.src.tail_path is not None else whole.name
        core = run.quantize(run.work / core_name, recipe, exclude, qat=qat)
        onnx_path = run.with_tail(core, whole)
        violations = [str(v) for v in check_qdq(
            onnx_path, activations_signed=recipe.activations_signed)]
    elif precision == "fp16" and run.job.target == "onnxruntime":
        core_name = "fp16.core.onnx" if run.src.tail_path is not None else whole.name
        onnx_path = run.with_tail(_fp16_onnx(run.float_core, run.work / core_name), whole)
    elif run.src.tail_path is not None and run.nms != "onnx":
        onnx_path = run.with_tail(run.float_core, whole)
    else:
        onnx_path = run.src.fp32_path
    if run.job.target == "onnxruntime":
        return onnx_path, onnx_path, violations
    engine = run.work / f"{step}.engine"
    build_engine(
        onnx_path, engine, precision=precision, sparse_weights=run.src.sparse,
        input_shape=run.src.input_shape, cfg=run.job.tensorrt,
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
        inputs=run.src.inputs,
        labels=run.src.labels,
        reference_logits=run.src.reference_logits,
        fidelity_logits=run.src.fidelity_logits,
        size_bytes=artefact.stat().st_size,
        cfg=g,
        task=run.src.task,
    )
    return judge(m, g)


def _install(src: Path, dest: Path) -> None:
    with atomic_output(dest) as tmp:
        shutil.copyfile(src, tmp)


def run_export(job: ExportJob) -> ExportReport:
    """Run ``job`` whole in this process (``agentctl export``, ``python -m exporters``); the
    report is also written to ``<out_dir>/report.json``."""
    t0 = time.perf_counter()
    from exporters.prepare import prepare  # torch: only where both halves share a process

    prepare(job)
    return quantize_and_gate(job, started=t0)


def quantize_and_gate(job: ExportJob, started: float | None = None) -> ExportReport:
    """The second half of ``job`` on what ``exporters.prepare`` handed over: quantize, gate,
    fall back step by step, install the winner; writes ``<out_dir>/report.json``."""
    t0 = time.perf_counter() if started is None else started
    work = job.out_dir / "work"
    src = read_prepared(work)
    report = src.report
    isa = detect_isa()
    recipe = choose_recipe(job.target, isa, job.int8_recipe)
    if job.precision == "int8":
        report.int8 = {"recipe": recipe.name, "reason": recipe.reason, "isa": isa.to_dict()}
    run = _Run(job, work, src, recipe)
    _run_attempts(run, report)
    report.fallback = fallback_note(report)
    if report.sensitivity is None and run.sensitivity is not None:
        report.sensitivity = [{"node": n, "logit_mse": s} for n, s in run.sensitivity]
    if run.qat is not None:
        report.qat = run.qat
    if not job.keep_intermediates:
        shutil.rmtree(work, ignore_errors=True)
    report.seconds += time.perf_counter() - t0
    write_report(report, job.out_dir / "report.json")
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
