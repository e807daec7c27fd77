"""The device job's fine-tune yields to the application serving the same model: a serving
process's stats (``agent.runtime.stats``) report a p99 over the device's SLO, the governor's
latency loop lowers the training duty, yields completely, and restores full speed once the
application stops reporting; the job report says how long training yielded. Also: a job that
asks for power-mode switching where none is possible says so in its report."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest

from agent.runtime.stats import ServingStats, write_stats
from tests.agent.jobs.conftest import Device


class _SlowApp(threading.Thread):
    """An application serving ``digits`` whose p99 is 40 ms for ``seconds``, then gone."""

    def __init__(self, device: Device, seconds: float) -> None:
        super().__init__(daemon=True)
        self.device, self.seconds = device, seconds
        self.stop = threading.Event()

    def run(self) -> None:
        end = time.monotonic() + self.seconds
        n = 0
        while time.monotonic() < end and not self.stop.is_set():
            n += 50
            write_stats(self.device.state, ServingStats(
                model="digits", version="v1", pid=os.getpid(), updated=time.time(),
                window_s=5.0, window_requests=50, p50_ms=20.0, p99_ms=40.0, requests=n,
                failed=0))
            time.sleep(0.2)


def _run(device: Device, capsys: pytest.CaptureFixture, job_id: str, *extra: str
         ) -> dict[str, Any]:
    from agent.cli import main

    argv = ["finetune", "--model", "digits", "--version", "v1", "--registry",
            device.registry.url, "--data", str(device.data), "--state-dir", str(device.state),
            "--profile", "generic-x86", "--sensors", "sim", "--trainable", "last_n:2",
            "--steps", "150", "--micro-batch", "32", "--no-export", "--job-id", job_id,
            "--progress", "json", *extra]
    assert main(argv) == 0
    capsys.readouterr()
    return json.loads((device.state / "jobs" / job_id / "finetune" / "report.json").read_text())


@pytest.mark.slow
def test_the_fine_tune_yields_while_the_app_is_over_its_slo(
        device: Device, capsys: pytest.CaptureFixture) -> None:
    app = _SlowApp(device, seconds=20.0)
    app.start()
    try:
        report = _run(device, capsys, "yield", "--latency-slo-ms", "20")
    finally:
        app.stop.set()
        app.join()
    summary = report["summary"]
    assert summary["worst_app_p99_ms"] == 40.0
    assert summary["yielded_s"] > 2.0, summary  # at min duty, then not at all
    reasons = [e["reason"] for e in report["events"]]
    assert any("application p99 40.0 ms vs SLO 20.0 ms" in r for r in reasons), reasons
    assert any("training yields" in r for r in reasons), (reasons, summary)
    assert any(s["limit"] == "latency" for s in report["samples"])
    assert report["job"]["steps"] == 150  # it yielded, then finished once nobody served

    # --no-yield-to-app: the same slow application, and training takes no notice.
    app = _SlowApp(device, seconds=8.0)
    app.start()
    try:
        report = _run(device, capsys, "noyield", "--latency-slo-ms", "20", "--no-yield-to-app",
                      "--switch-power-modes")
    finally:
        app.stop.set()
        app.join()
    assert report["summary"]["yielded_s"] == 0.0
    assert report["summary"]["worst_app_p99_ms"] is None
    # Power-mode switching was asked for, and this host cannot: the report says so.
    assert any(e["kind"] == "power_mode" and "power-mode switching unavailable" in e["reason"]
               for e in report["events"]), report["events"]
