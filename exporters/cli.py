"""Command line of an export job, shared by ``agentctl export`` and ``python -m exporters``.

Both build their parser with :func:`add_export_arguments` and run :func:`run_from_args`, so
the two commands take exactly the same flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

DESCRIPTION = """\
Prune, quantize and export a checkpoint, then gate the exported artefact on held-out data:
top-1 drop against the FP32 model, max |delta logit|, latency p50/p99 at batch 1 and at
--batch, file size. On a failed gate it retries automatically: INT8 with the most sensitive
layers left in float, then FP16, then FP32. The first step that passes is written to
OUT/model.onnx (and OUT/model.engine for TensorRT); OUT/report.json says what was tried
and why.

Exit status: 0 a step passed the gates, 1 none did, 2 the job is invalid."""

EPILOG = """\
examples:
  # INT8 for ONNX Runtime, gated at <= 1 point top-1 drop (the default)
  %(prog)s --checkpoint runs/digits --out exports/int8 --int8

  # 2:4 sparsity + 200-step recovery fine-tune + INT8 TensorRT engine (on a Jetson)
  %(prog)s --checkpoint runs/digits --out exports/trt --prune 2:4 --recovery-steps 200 \\
      --int8 --target tensorrt --trt-workspace-mb 512

  # half the channels of every independent layer, FP32, with latency gates at batch 32
  %(prog)s --checkpoint runs/digits --out exports/slim --prune channels:0.5 \\
      --batch 32 --max-p50-ms 5 --max-p99-ms 8

  # a full job from YAML (the fields of exporters.pipeline.ExportJob); flags override it
  %(prog)s --config export.yaml --out exports/from-yaml

--data takes: digits | a folder of class sub-folders (PNG/JPEG) | a .npz file (x, y).
Without it the checkpoint's own data config is used; either way images are resized to the
model's input size and the checkpoint's validation split stays the held-out set."""


OFF = "off"


def _optional_float(text: str) -> float | str:
    # "off" is kept as a marker (not None) so it can override a limit set in --config.
    if text.lower() in ("off", "none"):
        return OFF
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None


def build_parser(prog: str) -> argparse.ArgumentParser:
    """A stand-alone parser for the export job (``python -m exporters``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_export_arguments(parser)
    return parser


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """The export job's flags; every one maps onto a field of ``ExportJob``."""
    io = p.add_argument_group("input and output")
    io.add_argument("--checkpoint", type=Path, metavar="DIR",
                    help="checkpoint directory, or a run directory (uses its final/ or latest)")
    io.add_argument("--out", type=Path, metavar="DIR", help="output folder")
    io.add_argument("--data", metavar="SPEC",
                    help="digits | IMAGE_FOLDER | FILE.npz (default: the checkpoint's data)")
    io.add_argument("--config", type=Path, metavar="FILE.yaml",
                    help="job file with ExportJob fields; flags given here override it")
    io.add_argument("--json", action="store_true", help="print the report as JSON, not a table")
    io.add_argument("--keep-intermediates", action="store_true", default=None,
                    help="keep OUT/work (every attempt's artefact, calibration ranges)")

    pr = p.add_argument_group("pruning")
    pr.add_argument("--prune", metavar="SPEC",
                    help="2:4 | unstructured:AMOUNT[:global] | channels:AMOUNT (e.g. channels:0.5)")
    pr.add_argument("--recovery-steps", type=int, metavar="N",
                    help="fine-tune steps after pruning, masks kept (default 120; 0 = none)")
    pr.add_argument("--recovery-lr", type=float, metavar="LR",
                    help="fine-tune peak LR (default: the checkpoint's training LR)")

    q = p.add_argument_group("precision and target")
    prec = q.add_mutually_exclusive_group()
    prec.add_argument("--int8", dest="precision", action="store_const", const="int8",
                      help="start the chain at symmetric Q/DQ INT8")
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16",
                      help="start the chain at FP16")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                      help="FP32 only (the default)")
    q.add_argument("--target", choices=["onnxruntime", "tensorrt"],
                   help="artefact: ONNX for ONNX Runtime (default) or a TensorRT engine")
    q.add_argument("--calib", type=int, metavar="N", help="calibration samples (default 512)")
    q.add_argument("--calib-method", choices=["minmax", "percentile", "entropy"],
                   help="activation range estimator (default minmax)")
    q.add_argument("--opset", type=int, help="ONNX opset (default 18; 17 needs --exporter "
                   "torchscript)")
    q.add_argument("--exporter", choices=["dynamo", "torchscript"], help="torch.onnx exporter")
    q.add_argument("--trt-workspace-mb", type=int, metavar="MB",
                   help="TensorRT builder workspace limit (from the device profile)")
    q.add_argument("--trt-timing-cache", type=Path, metavar="FILE",
                   help="TensorRT timing cache, reused across builds")

    g = p.add_argument_group("gates (a limit of 'off' disables it)")
    g.add_argument("--max-top1-drop", type=_optional_float, metavar="PTS",
                   help="top-1 drop vs FP32, percentage points (default 1.0)")
    g.add_argument("--max-logit-delta", type=_optional_float, metavar="X",
                   help="max |logit - FP32 logit| (default off)")
    g.add_argument("--max-p50-ms-b1", type=_optional_float, metavar="MS")
    g.add_argument("--max-p99-ms-b1", type=_optional_float, metavar="MS")
    g.add_argument("--max-p50-ms", type=_optional_float, metavar="MS",
                   help="median latency at --batch")
    g.add_argument("--max-p99-ms", type=_optional_float, metavar="MS",
                   help="p99 latency at --batch")
    g.add_argument("--max-size-mb", type=_optional_float, metavar="MB")
    g.add_argument("--batch", type=int, metavar="N", help="the job's batch size, timed besides "
                   "batch 1 (default 32)")
    g.add_argument("--latency-iters", type=int, metavar="N", help="timed runs per batch (50)")
    g.add_argument("--threads", type=int, metavar="N",
                   help="ONNX Runtime threads while gating (default 1; 0 = all cores)")
    g.add_argument("--eval-samples", type=int, metavar="N",
                   help="held-out samples scored (default: the whole validation split)")
    g.add_argument("--no-fallback", action="store_true", default=None,
                   help="fail on the first failed gate instead of retrying")
    g.add_argument("--max-excluded-layers", type=int, metavar="K",
                   help="INT8 retries leave up to K most sensitive layers in float (default 3)")


def data_spec(text: str) -> dict[str, Any]:
    """``--data`` -> DataConfig fields."""
    if text == "digits":
        return {"source": "digits"}
    path = Path(text)
    if path.suffix == ".npz":
        return {"source": "npz", "path": str(path)}
    if path.is_dir():
        return {"source": "image_folder", "path": str(path)}
    raise ValueError(f"--data {text!r}: use digits, a folder of class sub-folders, or a .npz file")


# flag -> dotted ExportJob field
_FLAGS = {
    "checkpoint": "checkpoint", "out": "out_dir", "prune": "prune",
    "keep_intermediates": "keep_intermediates",
    "recovery_steps": "recovery.steps", "recovery_lr": "recovery.lr",
    "precision": "precision", "target": "target",
    "calib": "calibration.samples", "calib_method": "calibration.method",
    "opset": "onnx.opset", "exporter": "onnx.exporter",
    "trt_workspace_mb": "tensorrt.workspace_mb", "trt_timing_cache": "tensorrt.timing_cache",
    "batch": "gates.batch_size", "latency_iters": "gates.latency_iters",
    "threads": "gates.threads", "eval_samples": "gates.eval_samples",
    "max_excluded_layers": "fallback.max_excluded_layers",
}
_GATE_FLAGS = {
    "max_top1_drop": "max_top1_drop_pts", "max_logit_delta": "max_abs_logit_delta",
    "max_p50_ms_b1": "max_p50_ms_b1", "max_p99_ms_b1": "max_p99_ms_b1",
    "max_p50_ms": "max_p50_ms_batch", "max_p99_ms": "max_p99_ms_batch",
    "max_size_mb": "max_size_mb",
}


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = str(value) if isinstance(value, Path) else value


def job_tree(args: argparse.Namespace) -> dict[str, Any]:
    """The job as a dict: the --config file, overridden by the flags that were given."""
    tree: dict[str, Any] = {}
    if args.config is not None:
        loaded = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config}: top level must be a mapping of ExportJob fields")
        tree = loaded
    for flag, dotted in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            _set(tree, dotted, value)
    for flag, field in _GATE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            _set(tree, f"gates.{field}", None if value == OFF else value)
    if args.no_fallback:
        _set(tree, "fallback.enabled", False)
    if args.data is not None:
        tree["data"] = data_spec(args.data)
    return tree


def run_from_args(args: argparse.Namespace) -> int:
    from exporters.pipeline import ExportJob, run_export
    from exporters.report import render_table
    from hpc_core.checkpoint import CheckpointError
    from hpc_core.config import format_errors

    try:
        tree = job_tree(args)
        for required, flag in (("checkpoint", "--checkpoint"), ("out_dir", "--out")):
            if required not in tree:
                raise ValueError(f"{flag} is required (or set {required} in --config)")
        job = ExportJob.model_validate(tree)
    except ValidationError as e:
        print("invalid export job:\n" + "\n".join(format_errors(e, ExportJob)), file=sys.stderr)
        return 2
    except (ValueError, OSError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        report = run_export(job)
    except (CheckpointError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(render_table(report))
        print(f"report: {job.out_dir / 'report.json'}")
    return 0 if report.status == "passed" else 1

