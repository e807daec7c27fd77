"""benchmarks/harness.py: the verdict line's one format, and --quick's defaults."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.harness import VERDICT, parse_args, verdict


def test_verdict_line_states_the_ratio_beside_its_target(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert verdict("Trainer / plain loop step time ratio", 1.0171, "<=", 1.03)
    line = capsys.readouterr().out.strip()
    assert line == ("verdict: Trainer / plain loop step time ratio 1.017x (target <= 1.03x): "
                    "met")
    m = VERDICT.match(line)
    assert m is not None and m["value"] == "1.017" and m["target"] == "1.03"


def test_verdict_counts_the_other_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert not verdict("ping p99", 13.2, "<=", 5, "ms", note="ratio to echo 1.6x",
                       also=[("idle RSS", True), ("idle CPU", False)])
    line = capsys.readouterr().out.strip()
    assert line == ("verdict: ping p99 13.2ms (target <= 5ms): MISSED; ratio to echo 1.6x; "
                    "1/3 targets met (also missed: idle CPU)")
    assert VERDICT.match(line)


def test_a_nan_figure_is_missed(capsys: pytest.CaptureFixture[str]) -> None:
    assert not verdict("ratio", float("nan"), ">=", 0.97)
    line = capsys.readouterr().out.strip()
    assert line.endswith("nanx (target >= 0.97x): MISSED") and VERDICT.match(line)


def test_quick_sets_defaults_and_the_command_line_wins() -> None:
    def parser() -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser()
        ap.add_argument("--steps", type=int, default=60)
        ap.add_argument("--runs", type=int, default=10)
        return ap

    quick = {"steps": 2, "runs": 1}
    a = parse_args(parser(), quick, [])
    assert (a.quick, a.steps, a.runs) == (False, 60, 10)
    a = parse_args(parser(), quick, ["--quick"])
    assert (a.quick, a.steps, a.runs) == (True, 2, 1)
    a = parse_args(parser(), quick, ["--quick", "--runs", "3"])
    assert (a.steps, a.runs) == (2, 3)
