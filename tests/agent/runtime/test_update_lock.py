"""The update lock: an application's hold defers the device job's commit (up to the device's
limits.update_lock_max_wait_s, never a command's) and the application's own flip; a holder
killed with -9 releases it at once."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from agent.daemon.config import AgentConfig
from agent.daemon.jobspec import resolve_command_args
from agent.jobs.protocol import Canceled, JobContext
from agent.jobs.spec import DeployJob
from agent.jobs.steps import commit
from agent.jobs.store import JobStore
from agent.runtime.active_model import ActiveModel
from agent.runtime.update_lock import hold_update_lock, lock_path, wait_for_update_locks
from contract import CommandRejected
from tests.agent.runtime.conftest import MODEL, Device, served_version
from tests.agent.runtime.test_active_model import wait_for

ZERO = np.zeros((1, 1, 8, 8), np.float32)


def hold_for(state: Path, seconds: float) -> threading.Thread:
    entered = threading.Event()

    def hold() -> None:
        with hold_update_lock(state, MODEL):
            entered.set()
            time.sleep(seconds)

    t = threading.Thread(target=hold)
    t.start()
    entered.wait(5)
    return t


def test_the_wait_ends_when_the_holder_lets_go(device: Device) -> None:
    assert wait_for_update_locks(device.state, MODEL, 5) == 0.0  # no model folder yet
    device.install(1)
    assert wait_for_update_locks(device.state, MODEL, 5, poll_s=0.02) < 0.1  # nobody holds it
    mode = stat.S_IMODE(lock_path(device.state, MODEL).stat().st_mode)
    assert mode == 0o600  # the state dir is the service user's alone
    t = hold_for(device.state, 0.4)
    waited = wait_for_update_locks(device.state, MODEL, 5, poll_s=0.02)
    t.join()
    assert 0.3 <= waited < 2.0


def test_a_holder_that_never_lets_go_is_waited_for_max_wait_s_only(
        device: Device, caplog: pytest.LogCaptureFixture) -> None:
    device.install(1)
    t = hold_for(device.state, 1.5)
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        waited = wait_for_update_locks(device.state, MODEL, 0.3, poll_s=0.05)
    assert 0.3 <= waited < 1.0
    assert "committing anyway" in caplog.text
    with pytest.raises(RuntimeError, match="stop"):  # check() ends the wait early
        wait_for_update_locks(device.state, MODEL, 5, poll_s=0.02,
                              check=lambda: (_ for _ in ()).throw(RuntimeError("stop")))
    t.join()


def test_a_holder_killed_with_sigkill_releases_the_lock(device: Device,
                                                        subprocess_env: dict[str, str]) -> None:
    device.install(1)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path;"
         "from agent.runtime.update_lock import hold_update_lock\n"
         "with hold_update_lock(Path(sys.argv[1]), 'digits'):\n"
         "    print('held', flush=True); time.sleep(60)", str(device.state)],
        stdout=subprocess.PIPE, text=True, env=subprocess_env)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    threading.Timer(0.3, os.kill, args=(holder.pid, signal.SIGKILL)).start()
    waited = wait_for_update_locks(device.state, MODEL, 30, poll_s=0.02)
    holder.wait(10)
    assert 0.2 <= waited < 3.0


def test_the_lock_file_is_never_opened_through_a_symlink(device: Device,
                                                          tmp_path: Path) -> None:
    device.install(1)
    target = tmp_path / "elsewhere"
    target.write_text("")
    lock_path(device.state, MODEL).symlink_to(target)
    with pytest.raises(OSError), hold_update_lock(device.state, MODEL):
        pass


def _commit_ctx(device: Device, max_wait_s: float) -> JobContext:
    spec = DeployJob(model=MODEL, version="2", registry="/unused",
                     update_lock_max_wait_s=max_wait_s)
    store = JobStore(device.state)
    store.submit("d1", "deploy", spec.model_dump(mode="json"))
    ctx = JobContext(store, "d1", device.state, spec)
    ctx.outputs["stage"] = {"version": "2", "slot": "b", "sequence": 2}
    return ctx


def test_commit_waits_for_the_hold_and_the_application_flips_after_it(device: Device) -> None:
    device.install(1)
    device.stage(2)
    with ActiveModel(device.state, MODEL, poll_s=0.02) as model:
        out: dict = {}
        with model.hold_updates():
            step = threading.Thread(target=lambda: out.update(commit.run(_commit_ctx(device, 30))))
            step.start()
            time.sleep(0.5)
            assert step.is_alive() and device.slots.active().version == "1"  # type: ignore[union-attr]
        step.join(10)
        assert out["version"] == "2" and 0.4 <= out["update_lock_wait_s"] < 5
        wait_for(lambda: model.version == "2", what="the flip after the hold")


def test_past_max_wait_the_commit_goes_ahead_and_the_hold_still_defers_the_flip(
        device: Device) -> None:
    device.install(1)
    device.stage(2)
    with ActiveModel(device.state, MODEL, poll_s=0.02) as model:
        with model.hold_updates():
            out = commit.run(_commit_ctx(device, 0.3))
            assert out["version"] == "2" and 0.3 <= out["update_lock_wait_s"] < 2
            time.sleep(0.2)
            assert model.version == "1" and served_version(model.predict(ZERO)) == 1
        wait_for(lambda: model.version == "2", what="the flip after the hold")


def test_a_cancel_ends_the_commit_wait(device: Device) -> None:
    device.install(1)
    device.stage(2)
    ctx = _commit_ctx(device, 30)
    t = hold_for(device.state, 1.0)
    ctx.store.request_cancel("d1")
    with pytest.raises(Canceled, match="update lock"):
        commit.run(ctx)
    t.join()
    assert device.slots.active().version == "1"  # type: ignore[union-attr]


def test_the_max_wait_comes_from_the_device_config_never_a_command(tmp_path: Path) -> None:
    settings = AgentConfig.model_validate({
        "device_id": "edge-7", "state_dir": str(tmp_path), "registry": {"url": "/r"},
        "limits": {"update_lock_max_wait_s": 7}}).job_settings()
    dep = resolve_command_args("deploy", {"model": "digits", "version": "2"}, settings)
    assert dep["update_lock_max_wait_s"] == 7
    with pytest.raises((ValidationError, CommandRejected), match="update_lock_max_wait_s"):
        resolve_command_args("deploy", {"model": "digits", "version": "2",
                                        "update_lock_max_wait_s": 0}, settings)
