"""The export job models: torch-free, so the daemon and agentctl's parsers load without torch."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from exporters.cli import build_parser, job_tree
from exporters.job import ExportJob, PruneSpec
from hpc_core.job_args import validate_job

HEAVY = ("torch", "onnx", "onnxruntime")


def _run(python: str, env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_job_models_import_without_torch_onnx_or_onnxruntime(
    python: str, subprocess_env: dict[str, str]
) -> None:
    proc = _run(python, subprocess_env, (
        "import sys, exporters.job, agent.finetune.job, agent.jobs.spec\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["export", "--help"], ["finetune", "--help"]])
def test_agentctl_help_does_not_load_torch(
    argv: list[str], python: str, subprocess_env: dict[str, str]
) -> None:
    proc = _run(python, subprocess_env, (
        "import sys\nfrom agent.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))"
    ))
    assert proc.returncode == 0, proc.stderr
    assert "usage: agentctl" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "LOADED []"


def test_flags_build_the_job_and_off_clears_a_gate(tmp_path: Path) -> None:
    args = build_parser("export").parse_args([
        "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"), "--int8",
        "--prune", "unstructured:0.5:global", "--max-top1-drop", "off", "--max-size-mb", "4",
    ])
    job = validate_job(ExportJob, job_tree(args), "export job")
    assert job.precision == "int8" and job.out_dir == tmp_path / "o"
    assert job.prune == PruneSpec(method="unstructured", amount=0.5, scope="global")
    assert job.gates.max_top1_drop_pts is None  # "off", not the default 1.0
    assert job.gates.max_size_mb == 4.0

