"""hpc-train estimate: a probe of the real trainer, priced from configs/gpu_prices.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_core.cli import main
from hpc_core.estimate import DEFAULT_PRICES, _probe_gpu_key, load_prices

REPO = Path(__file__).resolve().parents[2]
ARGS = ["estimate", "--config", str(REPO / "configs/digits.yaml"), "--set", "training.epochs=2"]


def _estimate(capsys, *extra: str) -> dict:
    assert main([*ARGS, "--probe-steps", "5", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_prices_the_probe_and_states_its_assumptions(capsys) -> None:
    prices = load_prices(DEFAULT_PRICES)
    one = _estimate(capsys, "--gpu", "a100")
    probe = one["probe"]
    assert probe["device"] == "cpu" and probe["steps"] == 5 and probe["peak_mb"] > 0
    # digits: 1437 training samples / 64 = 22 steps per epoch, evaluated once per epoch.
    assert one["steps_per_epoch"] == 22 and one["total_steps"] == 44 and one["evaluations"] == 2
    assert one["samples_per_s"] == pytest.approx(64 / probe["step_s"])
    train_s = 44 * probe["step_s"]
    evals_s = 2 * (probe["eval_s"] + probe["save_s"]) + probe["save_s"]  # + the final save
    assert one["total_s"] == pytest.approx(train_s + evals_s)
    assert one["cost"] == pytest.approx(
        one["total_s"] / 3600 * prices.gpus["a100"].usd_per_gpu_hour
    )
    text = " ".join(one["assumptions"])
    assert prices.price_date in text and "did not run on a GPU" in text
    assert one["fits_memory"] is None  # CPU RSS says nothing about an A100's memory


def test_more_nodes_scale_throughput_by_the_stated_efficiency(capsys) -> None:
    many = _estimate(capsys, "--gpu", "h100", "--nodes", "2", "--gpus-per-node", "4",
                     "--scaling-efficiency", "0.75")  # fmt: skip
    per_gpu = 64 / many["probe"]["step_s"]
    assert many["samples_per_s"] == pytest.approx(per_gpu * 8 * 0.75)
    assert any("8 GPUs at 75% scaling efficiency" in a for a in many["assumptions"])
    assert many["gpu_hours"] == pytest.approx(many["total_s"] / 3600 * 8)


def test_gpu_names_map_to_table_entries() -> None:
    prices = load_prices(DEFAULT_PRICES)
    assert _probe_gpu_key("NVIDIA H100 80GB HBM3", prices) == "h100"
    assert _probe_gpu_key("NVIDIA A100-SXM4-80GB", prices) == "a100"
    assert _probe_gpu_key("NVIDIA GeForce RTX 4090", prices) is None


def test_unknown_gpu_and_bad_price_table_exit_2(tmp_path: Path, capsys) -> None:
    assert main([*ARGS, "--gpu", "b300"]) == 2
    assert "'b300' is not in the price table" in capsys.readouterr().err
    bad = tmp_path / "prices.yaml"
    bad.write_text("price_date: '2025-06'\ngpus:\n  a100: {name: A100, memory_gb: 80, usd: 1}\n")
    assert main([*ARGS, "--gpu", "a100", "--prices", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "gpus.a100.usd: unknown key" in err
