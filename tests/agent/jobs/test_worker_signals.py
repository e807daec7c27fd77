"""SIGTERM to the job process (what the daemon sends on stop, what systemd sends on shutdown)
suspends the job: the step's child is stopped, the worker exits 75 (EX_TEMPFAIL) and the job
stays IN_PROGRESS, to resume where it was — it neither runs on to the end nor fails."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from agent.jobs.store import JobState, JobStore
from tests.agent.jobs.conftest import REPO, Device
from tests.agent.jobs.test_device_job import submit


def test_sigterm_mid_finetune_suspends_the_job_with_exit_75(device: Device) -> None:
    device.install()
    # Far more steps than the test waits for: only a suspension ends this worker early.
    submit(device, "s1", finetune={"steps": 20_000}, steps={"export": False})
    p = subprocess.Popen([sys.executable, "-m", "agent.jobs.worker", "--state-dir",
                          str(device.state), "--job-id", "s1", "--no-parent-check"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    store = JobStore(device.state)
    try:
        deadline = time.monotonic() + 120
        while not any(s.name == "finetune" and s.status == "running"
                      for s in store.steps("s1")):
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            assert time.monotonic() < deadline, "the fine-tune step never started"
            time.sleep(0.2)
        time.sleep(2)  # inside the step's child, training
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75, (p.returncode, err[-2000:])
    rec = store.get("s1")
    assert rec is not None and rec.state is JobState.IN_PROGRESS, rec
    finetune = {s.name: s for s in store.steps("s1")}["finetune"]
    assert finetune.status != "done", finetune
