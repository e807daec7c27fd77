"""``agentctl`` (the real CLI, a subprocess) against a real ``edge-agent`` over its control
socket, with the broker unreachable: finetune --follow (the real device job, with the job's
progress display), finetune --daemon, status, deploy, cancel, send, jobs, logs; then the same
commands with the daemon stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.jobs.store import JobStore
from tests.agent.daemon.conftest import AgentProc
from tests.support.device import ProvisionedDevice
from tests.support.mosquitto import Broker, free_port


def _ctl(env: dict[str, str], state: Path, *argv: str, timeout: float = 60) -> Any:
    return subprocess.run([sys.executable, "-m", "agent.cli", *argv, "--state-dir", str(state)],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_agentctl_through_the_daemon_without_a_broker(
    agent: Callable[..., AgentProc], device: ProvisionedDevice, subprocess_env: dict[str, str],
    tmp_path: Path,
) -> None:
    nowhere = Broker("127.0.0.1", free_port(), tmp_path / "none.conf", tmp_path)  # never started
    a = agent(nowhere, **device.agent_config())
    state, env = device.state, subprocess_env
    # Through the daemon the data set is a name under its data_root (agent.yaml).
    ft = ["--model", "digits", "--data", device.data.name, "--profile", "generic-x86",
          "--sensors", "none", "--steps", "10000", "--effective-batch", "16", "--micro-batch", "16",
          "--no-export"]
    follow = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "finetune", *ft, "--job-id", "j1", "--follow",
         "--progress", "json", "--state-dir", str(state)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = JobStore(state)
    end = time.monotonic() + 60
    while not ((r := store.get("j1")) and r.state.value == "IN_PROGRESS"):
        assert time.monotonic() < end and follow.poll() is None, follow.communicate()
        time.sleep(0.1)

    # Queued behind j1, then canceled while queued: j1 runs long enough (10,000 steps, ~25 s
    # here) that a loaded machine does not end it between these commands (at 6 steps, ~8 s,
    # one did, and d1 ran and ended before its cancel). Not by stopping j1's worker: stopped
    # inside its progress write it held the job store's lock, and the daemon's accept of d1
    # waited out agentctl's 30 s.
    # Deployed from the daemon's own registry (agent.yaml): the command names none.
    r = _ctl(env, state, "deploy", "digits", "1", "--id", "d1")
    assert r.returncode == 0 and "d1: ACCEPTED" in r.stdout, r.stdout + r.stderr
    st = _ctl(env, state, "status", "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["connected"] is False and status["queued"] == ["d1"]
    assert status["job"]["id"] == "j1"
    assert "not connected" in _ctl(env, state, "status").stdout
    r = _ctl(env, state, "cancel", "d1")
    assert r.returncode == 0 and "SUCCEEDED" in r.stdout, r.stdout + r.stderr
    assert store.get("d1").state.value == "CANCELED"  # type: ignore[union-attr]

    # Any contract command through the socket; a bad one is REJECTED naming the field.
    r = _ctl(env, state, "send", "ping", "--follow")
    assert r.returncode == 0 and ": SUCCEEDED" in r.stdout, r.stdout + r.stderr
    r = _ctl(env, state, "send", "finetune", "--args", '{"data": "/x.npz"}')
    assert r.returncode == 2 and "REJECTED" in r.stdout and "args.model" in r.stdout, r.stdout
    # A trust root or a path is refused before anything is sent, naming the flag.
    r = _ctl(env, state, "finetune", *ft, "--registry", "http://evil:8080", "--daemon")
    assert r.returncode == 2 and "--registry is the daemon's own" in r.stderr, r.stderr
    r = _ctl(env, state, "send", "deploy", "--args",
             '{"model": "digits", "version": "1", "trusted_keys": "/tmp"}')
    assert r.returncode == 2 and "args.trusted_keys" in r.stdout, r.stdout

    out, err = follow.communicate(timeout=180)
    assert follow.returncode == 0, out + err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["job"] == "j1" and summary["state"] == "SUCCEEDED"
    assert summary["result"]["outcome"] == "committed"
    # The job's own progress display: one JSON line per stage event, then the summary rows.
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert {"finetune", "stage", "health"} <= {e["stage"] for e in events}, err[-2000:]
    assert "accuracy (held-out device data)" in err and "committed" in err

    r = _ctl(env, state, "finetune", *ft, "--job-id", "j1", "--daemon")  # same id again
    assert r.returncode == 0 and "DUPLICATE (stored SUCCEEDED)" in r.stdout, r.stdout + r.stderr
    jobs = _ctl(env, state, "jobs").stdout
    assert "j1" in jobs and "SUCCEEDED" in jobs and "d1" in jobs and "CANCELED" in jobs
    logs = _ctl(env, state, "logs", "j1", "-n", "5")
    assert logs.returncode == 0 and "worker done" in logs.stdout, logs.stdout

    # The daemon stopped: status says so (exit 3); the foreground paths still work.
    assert a.stop() == 0
    r = _ctl(env, state, "status")
    assert r.returncode == 3 and "no edge-agent listening" in r.stderr
    assert "worker done" in _ctl(env, state, "logs", "j1").stdout
    r = _ctl(env, state, "cancel", "j1")
    assert r.returncode == 1 and "already ended SUCCEEDED" in r.stderr
    r = _ctl(env, state, "finetune", *ft, "--job-id", "j2", "--follow")
    assert r.returncode == 3 and "no edge-agent listening" in r.stderr

