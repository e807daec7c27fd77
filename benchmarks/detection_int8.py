"""Detection INT8: a trained SSDlite exported with NMS in the graph, FP32 against three INT8
forms, on the clean held-out images and through a device camera.

The forms, each the ONNX file the export pipeline (``exporters.pipeline``) would install:

- ``fp32``: the network, box decoding and NMS in float;
- ``int8 PTQ``: post-training INT8 of the whole network (Q/DQ, ONNX Runtime's quantizer,
  the recipe this host calls for), decoding and NMS in float;
- ``int8 + fallback``: symmetric INT8 with the 1, 2, ... ``--max-excluded`` layers most
  sensitive to quantization (measured on the raw head) left in float, the fewest that meet
  the target (or all of them tried);
- ``int8 QAT``: ``--qat-steps`` of fake-quant fine-tuning (``exporters.qat``), then INT8.

Reported for each: mAP@0.5 and mAP@0.5:0.95 (pycocotools) on the synthetic held-out split
and on the same split seen through ``--camera`` (a shift the model never trained on), the
drop from FP32, the layers kept in float, latency p50/p99 at batch 1 and 8 in ONNX Runtime on
this CPU (``--threads``), the file size; and this CPU's flags (``exporters.cpu_isa``).

Target: an INT8 form within 1 point of FP32's mAP@0.5 on the clean held-out split
(the best of PTQ, fallback and QAT; the headline is PTQ's own drop when it meets it).

    python benchmarks/detection_int8.py --upstream /tmp/detup [--held-out 64] [--quick]

Without ``--upstream`` an upstream is trained first with ``benchmarks/detection.py``'s recipe
(``configs/detection_cpu.yaml``; ``--images``, ``--size``, ``--steps`` shrink it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

from benchmarks.harness import cpu_line, fmt, parse_args, verdict  # noqa: E402
from exporters.cpu_isa import detect_isa  # noqa: E402
from exporters.gates import GateMeasurement, measure  # noqa: E402
from exporters.job import ExportJob  # noqa: E402
from exporters.ort_runner import OrtRunner  # noqa: E402

TARGET_DROP_PTS = 1.0

DETECTION_CONFIG = REPO / "configs/detection_cpu.yaml"
"""What trains the upstream when no --upstream is given (benchmarks/detection.py's default)."""


@dataclass
class Form:
    name: str
    path: Path
    excluded: list[str] = field(default_factory=list)
    clean: GateMeasurement | None = None
    shifted: GateMeasurement | None = None
    seconds: float = 0.0

    def drop(self, fp32: Form, which: str = "clean") -> float:
        mine, ref = getattr(self, which), getattr(fp32, which)
        return (ref.map50 - mine.map50) * 100.0


def _upstream(args: argparse.Namespace, tmp: Path) -> Path:
    if args.upstream is not None:
        return Path(args.upstream)
    from benchmarks.detection import train_upstream, upstream_config

    cfg = upstream_config(tmp / "upstream", args)
    up = train_upstream(cfg, args.budget_s)
    print(f"upstream trained here: {up.steps} steps, mAP@0.5 {fmt(up.metrics['eval/map50'])}")
    return cfg.run.output_dir


def _job(args: argparse.Namespace, checkpoint: Path, out: Path) -> ExportJob:
    return ExportJob.model_validate({
        "checkpoint": str(checkpoint), "out_dir": str(out), "precision": "int8",
        "calibration": {"samples": args.calib, "batch_size": 8},
        "gates": {"batch_size": 8, "threads": args.threads, "eval_samples": args.held_out,
                  "latency_iters": args.iters, "latency_warmup": 2, "max_top1_drop_pts": None,
                  "max_map50_drop_pts": TARGET_DROP_PTS},
        "fallback": {"max_excluded_layers": args.max_excluded, "qat": True,
                     "sensitivity_samples": args.sensitivity_samples},
        "qat": {"steps": args.qat_steps, "lr": args.qat_lr, "batch_size": 8},
        "keep_intermediates": True,
    })


def _shifted_data(job: ExportJob, camera: str) -> tuple[np.ndarray, np.ndarray]:
    """The job's held-out split drawn again through ``camera``."""
    from exporters.detection.form import DetectionForm
    from exporters.prepare import load_source
    from hpc_core.config import DataConfig
    from hpc_core.tasks import get_task

    src = load_source(job)
    data = src.config.data.model_dump(mode="json")
    data["synthetic"] = {**(data.get("synthetic") or {}), "cameras": [camera]}
    _, val, _ = get_task("detection").build_datasets(DataConfig.model_validate(data))
    return DetectionForm().held_out(val, job.gates.eval_samples)


def _score(form: Form, job: ExportJob, src: Any, shifted: tuple[np.ndarray, np.ndarray],
           ref_shifted: np.ndarray) -> None:
    runner = OrtRunner(form.path, threads=job.gates.threads)
    common = {"size_bytes": form.path.stat().st_size, "cfg": job.gates, "task": "detection"}
    form.clean = measure(runner, inputs=src.inputs, labels=src.labels,
                         reference_logits=src.reference_logits,
                         fidelity_logits=src.fidelity_logits, **common)
    x, rows = shifted
    form.shifted = measure(runner, inputs=x, labels=rows, reference_logits=ref_shifted,
                           fidelity_logits=ref_shifted, **common)


def run_forms(args: argparse.Namespace, job: ExportJob) -> tuple[list[Form], Any]:
    """Every form's artefact, made by the export pipeline's own steps."""
    from exporters.int8_recipe import Int8Recipe, choose_recipe
    from exporters.pipeline import QAT_STEP, _make_artefact, _Run
    from exporters.prepare import prepare
    from exporters.runtime import predict

    src = prepare(job)
    work = job.out_dir / "work"
    run = _Run(job, work, src, choose_recipe("onnxruntime", detect_isa()))
    exact = run.exact_recipe
    shifted = _shifted_data(job, args.camera)
    ref_shifted = predict(OrtRunner(src.fp32_path, threads=job.gates.threads), shifted[0],
                          batch=8)
    forms: list[Form] = []

    def made(name: str, step: str, exclude: list[str], recipe: Int8Recipe | None) -> Form:
        t = time.perf_counter()
        path, _, _ = _make_artefact(run, step, "int8" if recipe else "fp32", exclude, recipe)
        form = Form(name, path, exclude)
        _score(form, job, src, shifted, ref_shifted)
        form.seconds = time.perf_counter() - t
        return form

    forms.append(made("fp32", "fp32", [], None))
    forms.append(made("int8 PTQ", "int8", [], run.recipe))
    ranked = [n for n, _ in run.layer_sensitivity()]
    best: Form | None = None
    for k in range(1, args.max_excluded + 1):
        form = made(f"int8 + fallback ({k} in float)", f"int8-exclude-{k}", ranked[:k], exact)
        best = form
        if form.drop(forms[0]) <= TARGET_DROP_PTS:
            break
    if best is not None:
        forms.append(best)
    qat = made("int8 QAT", QAT_STEP, [], exact)
    forms.append(qat)
    return forms, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", type=Path, default=None,
                    help="a trained detector's run or checkpoint folder (default: train one)")
    ap.add_argument("--held-out", type=int, default=None,
                    help="held-out images scored (default: the whole validation split)")
    ap.add_argument("--calib", type=int, default=256, help="calibration images")
    ap.add_argument("--camera", default="noise", help="the device camera of the shifted set")
    ap.add_argument("--max-excluded", type=int, default=3,
                    help="most layers the fallback leaves in float")
    ap.add_argument("--sensitivity-samples", type=int, default=32,
                    help="calibration images the layer ranking runs")
    ap.add_argument("--qat-steps", type=int, default=300, help="QAT fine-tune steps")
    ap.add_argument("--qat-lr", type=float, default=2e-4, help="QAT learning rate")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads")
    ap.add_argument("--iters", type=int, default=50, help="timed runs per batch size")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="training cap when no --upstream is given")
    ap.add_argument("--config", type=Path, default=DETECTION_CONFIG,
                    help="the training config when no --upstream is given (default: "
                    "configs/detection_cpu.yaml)")
    for name in ("images", "size", "batch", "steps"):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"training {name} when no --upstream is given")
    args = parse_args(ap, {"images": 8, "size": 64, "batch": 4, "steps": 3, "held_out": 4,
                           "calib": 8, "max_excluded": 1, "sensitivity_samples": 4,
                           "qat_steps": 2, "iters": 3}, argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="detection-int8-") as tmp:
        checkpoint = _upstream(args, Path(tmp))
        job = _job(args, checkpoint, Path(tmp) / "export")
        forms, run = run_forms(args, job)
        report(args, forms, run, checkpoint)
    fp32 = forms[0]
    int8 = forms[1:]
    best = min(int8, key=lambda f: f.drop(fp32))
    ptq = forms[1]
    print(f"total {fmt(time.perf_counter() - t0)} s")
    verdict("INT8 mAP@0.5 drop from FP32 (best INT8 form)", best.drop(fp32), "<=",
            TARGET_DROP_PTS, "pts",
            also=[(f"PTQ alone within {TARGET_DROP_PTS:g} pts", ptq.drop(fp32) <= TARGET_DROP_PTS)],
            note=f"best: {best.name}; PTQ {fmt(ptq.drop(fp32))} pts, "
            f"FP32 mAP@0.5 {fmt(fp32.clean.map50)}")  # type: ignore[union-attr]
    return 0


def report(args: argparse.Namespace, forms: list[Form], run: Any, checkpoint: Path) -> None:
    fp32 = forms[0]
    src = run.src
    print(cpu_line())
    print(f"ISA: {detect_isa().label}; INT8 recipe {run.recipe.name} ({run.recipe.reason})")
    print(f"load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"## {checkpoint}: {src.report.model.get('name')} {src.report.model.get('kwargs')} "
          f"at {src.input_shape[-1]} px; {len(src.inputs)} held-out images (clean and "
          f"through camera {args.camera}), {len(src.calib)} calibration images")
    print("| form | mAP@0.5 | mAP@0.5:0.95 | drop mAP@0.5 pts | camera mAP@0.5 | camera "
          "mAP@0.5:0.95 | camera drop pts | b1 p50/p99 ms | b8 p50/p99 ms | MB | in float |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for f in forms:
        c, s = f.clean, f.shifted
        assert c is not None and s is not None
        print(f"| {f.name} | {fmt(c.map50)} | {fmt(c.top1)} | {fmt(f.drop(fp32))} | "
              f"{fmt(s.map50)} | {fmt(s.top1)} | {fmt(f.drop(fp32, 'shifted'))} | "
              f"{fmt(c.latency_b1.p50_ms)}/{fmt(c.latency_b1.p99_ms)} | "
              f"{fmt(c.latency_batch.p50_ms)}/{fmt(c.latency_batch.p99_ms)} | "
              f"{fmt(c.size_mb)} | {', '.join(f.excluded) or '-'} |")
    if run.sensitivity:
        top = ", ".join(f"{n} {s:.3g}" for n, s in run.sensitivity[:5])
        print(f"most sensitive layers (raw-head MSE when quantized alone): {top}")
    if run.qat:
        print(f"QAT fine-tune: {run.qat.get('steps')} steps in {fmt(float(run.qat['seconds']))} "
              f"s, metrics under fake quantization {run.qat.get('metrics')}")
    print("seconds per form (make + score): "
          + ", ".join(f"{f.name} {fmt(f.seconds)}" for f in forms))


if __name__ == "__main__":
    sys.exit(main())
