"""The budget binds the whole device job, export and health included: an upstream resnet at
48 px, device data at 48 px, 450 MB (the issue's run). Every step's process tree stays
<= 1.05 x the budget, and the job's report agrees with an outside sampler (PSS of the
worker's tree every 10 ms) within 5%. Before the export ran in two processes its tree
reached 1.20 x."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.jobs.proctree import tree_pss_mb
from agent.jobs.spec import DeviceJob
from agent.jobs.store import JobState, JobStore
from tests.agent.jobs.conftest import REPO, build_template, make_device, publish_v1
from tests.support.registry_server import RegistryServer

BUDGET = 450.0
"""The issue's run. The test ran at 500 MB for a while: on a freshly installed host the probes'
fixed cost measured ~460 MB then. Since each step's child imports its own module alone (and
the export children drop their cold start-up pages), a fresh install peaks at ~432 MB (export),
~395 MB (fine-tune), ~316 MB (health). On Linux 6.18, whose faults map whole large folios, a
fresh install was refused (~458 MB for one sample) until dropped pages came back one page at a
time (agent.finetune.page_faults) and the probes' start-up peak was kept apart from the
step's: then 394 MB (export), 419 MB (fine-tune), 370 MB (health)."""


class OutsideSampler(threading.Thread):
    """Summed PSS of a process tree every 10 ms, independent of the job's own sampler."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.done = root, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, tree_pss_mb(self.root))
            self.done.wait(0.01)


@pytest.mark.slow
def test_every_step_of_a_48px_resnet_job_stays_within_the_budget(tmp_path: Path) -> None:
    template = build_template(tmp_path / "template", [
        "training.epochs=1", "model.name=resnet", "model.kwargs={width: 16, norm: batch}"],
        image_size=48)
    publish_v1(template, tmp_path / "registry")
    with RegistryServer(tmp_path / "registry") as reg:
        dev = make_device(template, reg, tmp_path / "device")
        dev.install()
        spec = DeviceJob.model_validate(dev.spec(finetune={
            "micro_batch": None, "budget_mb": BUDGET, "steps": 10, "effective_batch": 64,
            "trainable": "all"}))
        store = JobStore(dev.state)
        store.submit("budget", "finetune", spec.model_dump(mode="json"))
        store.close()
        p = subprocess.Popen([sys.executable, "-m", "agent.jobs.worker", "--state-dir",
                              str(dev.state), "--job-id", "budget", "--no-parent-check"],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        outside = OutsideSampler(p.pid)
        outside.start()
        try:
            _, err = p.communicate(timeout=900)
        finally:
            outside.done.set()
            outside.join()
    store = JobStore(dev.state)
    rec = store.get("budget")
    assert p.returncode == 0 and rec is not None, err[-2000:]
    assert rec.state is JobState.SUCCEEDED, (rec.error, err[-2000:])
    assert rec.result["export"]["winner"], rec.result["export"]
    mem = rec.result["memory"]
    steps = mem["steps_peak_mb"]
    assert {"pull", "finetune", "export", "stage", "health", "commit"} <= set(steps), steps
    for step, peak in steps.items():
        assert peak <= 1.05 * BUDGET, f"{step}: {peak:.0f} MB > 1.05 x {BUDGET:.0f} MB ({steps})"
    assert mem["peak_tree_mb"] == max(steps.values()), mem
    assert outside.peak <= 1.05 * BUDGET, outside.peak
    assert abs(mem["peak_tree_mb"] - outside.peak) <= 0.05 * outside.peak, (mem, outside.peak)
