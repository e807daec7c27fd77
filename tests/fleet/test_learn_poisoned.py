"""``fleetctl learn`` for two rounds with the real ``hpc-train aggregate`` and ``publish`` on
real device-signed uploads, one device poisoned, and the controller SIGKILLed mid-round: the
median holds the poisoned device off both releases, and the resumed learn runs nothing twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fleet.mqtt import BrokerConfig
from tests.fleet.conftest import fleetctl_argv
from tests.fleet.learn_sim import (
    Scores,
    learn_status,
    mlp_registry,
    open_jobs,
    read_tensors,
    round_state,
    start,
)

POISONED = "sim-0004"
SCALE = 50.0


def test_median_holds_a_poisoned_device_off_two_rounds_across_a_controller_sigkill(
    broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    reg = mlp_registry(tmp_path / "fleet", devices=5)
    scores = Scores(registry=reg, gain=0.01, poisoned={POISONED: SCALE})
    fleet = start(broker, scores, devices=5, behavior={"job_duration_s": 0.6})
    db = tmp_path / "fleet.db"
    fleetctl = [*fleetctl_argv(broker, tmp_path), "learn"]
    try:
        log = open(tmp_path / "controller-0.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([
            *fleetctl, "start", "pz", "--group", "sim", "--model", "digits", "--base", "1",
            "--data", "cam0", "--registry", str(reg.root), "--trusted-keys", str(reg.trusted),
            "--sign-key", str(reg.work / "keys" / "upstream.key.pem"),
            "--hpc-train", f"{sys.executable} -m hpc_core.cli", "--rounds", "2",
            "--strategy", "median", "--min-updates", "5", "--min-devices", "5",
            "--max-device-drop", "1", "--timeout-s", "60"],
            env=subprocess_env, stdout=log, stderr=log)
        log.close()
        # Round 2's evaluations are out on the devices: kill the controller there.
        deadline = time.monotonic() + 120
        def round_2_evaluating() -> bool:
            rs = round_state(db, "pz") or {}
            return (rs.get("round"), rs.get("phase")) == (2, "evaluate") \
                and open_jobs(db, "pz-r2-ev") > 0

        while not round_2_evaluating():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "controller-0.log").read_text()[-3000:]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.5)  # evaluations finish while no controller runs
        r = subprocess.run([*fleetctl, "run", "pz"], capture_output=True, text=True,
                           env=subprocess_env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        fleet.stop()
    assert not fleet.errors, fleet.errors
    s = learn_status(tmp_path, "pz")
    assert s["state"] == "finished" and s["base"] == "pz-r2"
    assert [h["outcome"] for h in s["history"]] == ["published", "published"]
    for rnd, h in enumerate(s["history"], start=1):
        # Nothing that finished before the kill ran again: one aggregate, one candidate, one
        # release per round.
        assert h["tool_runs"] == {"aggregate": 1, "candidate": 1, "publish": 1}, h
        assert h["updates"]["combined"] == 5
        base_version = "1" if rnd == 1 else "pz-r1"
        _, base = read_tensors(reg, base_version)
        uploads = [v for _, v in scores.uploads if v.startswith(base_version + "+")]
        assert sorted(h["combined"]) == sorted(uploads) and len(uploads) == 5
        ups = {v: read_tensors(reg, v)[1] for v in uploads}
        _, release = read_tensors(reg, f"pz-r{rnd}")
        honest = [t for v, t in ups.items() if f"+{POISONED}." not in v]
        (bad,) = [t for v, t in ups.items() if f"+{POISONED}." in v]
        for k, got in release.items():
            deltas = np.stack([u[k] - base[k] for u in ups.values()])
            np.testing.assert_allclose(got, base[k] + np.median(deltas, axis=0), atol=1e-6)
            # The median's step is an honest device's size; fedavg's would be the poisoned
            # device's delta / 5, ~10x an honest one.
            step = np.linalg.norm(got - base[k])
            honest_step = np.mean([np.linalg.norm(u[k] - base[k]) for u in honest])
            fedavg_step = np.linalg.norm(np.mean(deltas, axis=0))
            assert step <= 1.5 * honest_step < fedavg_step / 3, (k, step, honest_step)
            assert np.linalg.norm(bad[k] - base[k]) > 20 * honest_step
    # Every device ran each job once (re-sent ones were answered DUPLICATE): two fine-tunes
    # and two evaluations.
    for d in fleet.devices.values():
        assert len(d.executed) == len(set(d.executed)) == 4, (d.id, d.executed)
