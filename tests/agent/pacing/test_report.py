"""Job report: JSON and PNG from what the governor hook recorded during a simulated job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from agent.pacing.governor import Governor, GovernorConfig
from agent.pacing.hook import GovernorHook
from agent.pacing.report import Limits, build_report, write_report
from agent.sensors.sim import SimBackend
from agent.sim.job import SimModeSwitcher
from agent.sim.plant import SimClock, SimPlant
from device_profiles import load_profile

NANO = load_profile("jetson-orin-nano-8gb")


def _paced_job(seconds: float = 1200.0) -> tuple[GovernorHook, SimPlant]:
    plant = SimPlant(NANO, ambient_c=35.0, mode="MAXN_SUPER")
    switcher = SimModeSwitcher(plant)
    cfg = GovernorConfig.from_profile(NANO, mode="MAXN_SUPER", allow_mode_switch=True)
    hook = GovernorHook(Governor(cfg, profile=NANO, switcher=switcher), SimBackend(plant),
                        clock=SimClock(plant), power_mode=switcher)

    class Trainer:
        def request_stop(self, reason: str) -> None:
            raise AssertionError(reason)

    step, loss = 0, 2.3
    while plant.time_s < seconds:
        plant.run_step()
        step += 1
        loss *= 0.999
        metrics = {"train/loss": loss}
        if step % 500 == 0:
            metrics["eval/acc"] = min(0.99, 0.5 + step / 10000)
        hook.on_step_end(Trainer(), step, metrics)
    return hook, plant


def test_report_json_and_png(tmp_path: Path) -> None:
    hook, plant = _paced_job()
    limits = Limits(target_c=85.0, soft_pause_c=95.0, board_throttle_c=99.0, critical_c=104.5)
    report = build_report(hook, limits, job={"name": "sim-job", "profile": NANO.name})
    json_path, png_path = write_report(report, tmp_path / "job")

    data = json.loads(json_path.read_text())
    assert data["format"] == "edgetrain.job_report/1"
    assert data["job"] == {"name": "sim-job", "profile": "jetson-orin-nano-8gb"}
    s = data["summary"]
    assert s["steps"] == hook.record.steps
    assert s["steps"] - 10 < data["samples"][-1]["step"] <= s["steps"]  # sampled each second
    assert s["max_temp_c"] == pytest.approx(max(x["temp_c"] for x in data["samples"]))
    assert s["max_temp_c"] <= 86.0 and s["time_above_target_s"] <= 60.0
    assert 0.3 < s["mean_duty"] < 1.0
    evals = [m for m in data["metrics"] if "eval/acc" in m]
    assert [m["step"] for m in evals] == [k for k in range(500, s["steps"] + 1, 500)]
    assert s["final_eval_acc"] == evals[-1]["eval/acc"]
    assert s["final_train_loss"] < 2.3
    # About one sample per simulated second, with every field the plot needs.
    assert abs(len(data["samples"]) - plant.time_s) < 0.1 * plant.time_s
    assert {"t_s", "temp_c", "power_mw", "duty", "state", "power_mode"} <= set(data["samples"][0])
    assert {e["kind"] for e in data["events"]} == {"state", "power_mode"}

    with Image.open(png_path) as im:
        assert im.format == "PNG" and im.size[0] > 800 and im.size[1] > 800
    # Written atomically: nothing but the two files is left behind.
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["report.json", "report.png"]


def test_report_without_metrics_or_samples(tmp_path: Path) -> None:
    plant = SimPlant(NANO)
    hook = GovernorHook(Governor(GovernorConfig.from_profile(NANO)), SimBackend(plant),
                        clock=SimClock(plant))
    report = build_report(hook, Limits(target_c=85.0, power_cap_w=10.0))
    json_path, png_path = write_report(report, tmp_path, stem="empty")
    data = json.loads(json_path.read_text())
    assert data["summary"]["steps"] == 0 and data["summary"]["max_temp_c"] is None
    assert png_path.stat().st_size > 0
