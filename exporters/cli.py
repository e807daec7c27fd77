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

from exporters.job import ExportJob
from hpc_core.config import ConfigError
from hpc_core.job_args import add_job_arguments, validate_job
from hpc_core.job_args import job_tree as flags_tree

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

  # a full job from YAML (the fields of exporters.job.ExportJob); flags and --set override it
  %(prog)s --config export.yaml --out exports/from-yaml --set gates.latency_warmup=2

--data takes: digits | a folder of class sub-folders (PNG/JPEG) | a .npz file (x, y).
Without it the checkpoint's own data config is used; either way images are resized to the
model's input size and the checkpoint's validation split stays the held-out set."""


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
    """The export job's flags: derived from ``ExportJob`` (one flag per field, see
    ``hpc_core.job_args``), plus the ``--data`` shorthand and ``--json``."""
    add_job_arguments(p, ExportJob)
    io = p.add_argument_group("input and output")
    io.add_argument("--data", metavar="SPEC",
                    help="digits | IMAGE_FOLDER | FILE.npz (default: the checkpoint's data)")
    io.add_argument("--json", action="store_true", help="print the report as JSON, not a table")


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


def job_tree(args: argparse.Namespace) -> dict[str, Any]:
    """The job as a dict: the --config file, the flags given, --set, and --data."""
    tree = flags_tree(args)
    if args.data is not None:
        tree["data"] = data_spec(args.data)
    return tree


def run_from_args(args: argparse.Namespace) -> int:
    from exporters.pipeline import run_export  # torch, ONNX: only to run a job
    from exporters.report import render_table
    from hpc_core.checkpoint import CheckpointError

    try:
        job = validate_job(ExportJob, job_tree(args), "export job")
    except ConfigError as e:
        print("invalid " + str(e), file=sys.stderr)
        return 2
    except ValueError as e:
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

