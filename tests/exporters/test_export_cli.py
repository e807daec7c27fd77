from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.cli import build_parser as agentctl_parser
from agent.cli import main as agentctl
from exporters.__main__ import main as exporters_main
from exporters.cli import build_parser
from exporters.cpu_isa import detect_isa
from exporters.int8_recipe import choose_recipe

FAST = ["--latency-iters", "3", "--batch", "8"]


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_agentctl_export_and_python_m_exporters_take_the_same_flags() -> None:
    root = agentctl_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    export = sub.choices["export"]
    ours = _options(build_parser("python -m exporters"))
    assert _options(export) == ours
    assert {"--checkpoint", "--data", "--out", "--prune", "--int8", "--target", "--calib",
            "--max-top1-drop", "--max-p99-ms"} <= ours


def test_help_teaches_the_forms(python: str, subprocess_env: dict[str, str]) -> None:
    out = subprocess.run([python, "-m", "exporters", "--help"], capture_output=True, text=True,
                         env=subprocess_env, check=True).stdout
    for text in ("2:4", "unstructured:AMOUNT", "channels:0.5", "--target", "examples:",
                 "Exit status"):
        assert text in out


def test_int8_export_end_to_end_as_a_user_runs_it(
    cnn: Any, tmp_path: Path, python: str, subprocess_env: dict[str, str]
) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [python, "-m", "exporters", "--checkpoint", str(cnn.checkpoint.parent.parent),
         "--out", str(out), "--int8", "--calib", "256", "--json", *FAST],
        capture_output=True, text=True, env=subprocess_env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "passed" and report["winner"] == "int8"
    assert report["job"]["calibration"]["samples"] == 256
    assert report["checkpoint"] == str(cnn.checkpoint)  # the run dir resolved to final/
    assert {p.name for p in out.iterdir()} == {
        "model.onnx", "model.onnx.json", "model.fp32.onnx", "report.json"}
    # The recipe this host calls for, and why, in the report and beside the file.
    expected = choose_recipe("onnxruntime", detect_isa())
    assert report["int8"]["recipe"] == expected.name
    assert report["int8"]["isa"]["label"] == detect_isa().label
    info = json.loads((out / "model.onnx.json").read_text())
    assert info["int8"]["recipe"] == expected.name and info["step"] == "int8"
    assert info["sha256"] == report["artefact_sha256"] and info["fallback"] is None


def test_agentctl_export_prints_the_summary_table(
    cnn: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = agentctl(["export", "--checkpoint", str(cnn.checkpoint), "--out", str(tmp_path),
                     "--fp32", "--max-top1-drop", "off", "--data", "digits", *FAST])
    out = capsys.readouterr().out
    assert code == 0
    assert "winner: fp32 -> model.onnx" in out and "b8 p50/p99 ms" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["job"]["gates"]["max_top1_drop_pts"] is None


def test_failed_gates_exit_1(cnn: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = exporters_main(["--checkpoint", str(cnn.checkpoint), "--out", str(tmp_path),
                           "--int8", "--no-fallback", "--max-size-mb", "0.001", *FAST])
    assert code == 1
    assert "no attempt met the gates" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prune", "3:8"], "prune"),
        (["--calib", "0"], "calibration.samples"),
        (["--data", "nowhere.csv"], "--data"),
    ],
)
def test_invalid_jobs_exit_2_naming_the_problem(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = exporters_main(["--checkpoint", str(tmp_path), "--out", str(tmp_path), *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_config_file_with_flags_overriding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("checkpoint: /nowhere\nout_dir: /tmp/x\ngates: {max_top1_drop: 1}\n")
    assert exporters_main(["--config", str(cfg)]) == 2
    assert "gates.max_top1_drop: unknown key (did you mean 'max_top1_drop_pts'?)" in (
        capsys.readouterr().err
    )
    cfg.write_text(f"checkpoint: {tmp_path}/nothing\nout_dir: {tmp_path}/out\n")
    assert exporters_main(["--config", str(cfg)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert exporters_main(["--out", str(tmp_path)]) == 2
    assert "--checkpoint is required" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="TensorRT is installed: the missing-TensorRT message cannot show")
def test_tensorrt_target_without_tensorrt_exits_2_with_the_alternative(
    cnn: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = exporters_main(["--checkpoint", str(cnn.checkpoint), "--out", str(tmp_path),
                           "--int8", "--target", "tensorrt"])
    assert code == 2
    assert "target=onnxruntime" in capsys.readouterr().err
    assert not (tmp_path / "model.fp32.onnx").exists()  # failed before any work
