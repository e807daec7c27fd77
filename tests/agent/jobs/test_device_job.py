"""The device job, whole: real fine-tune on distorted digits, real INT8 export and gates, A/B
slots, signed upload to a loopback HTTP registry; restarts after kill -9; bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.jobs.outcome import EXPORT_FIGURES
from agent.jobs.spec import DeviceJob
from agent.jobs.store import JobState, JobStore
from exporters.cpu_isa import detect_isa
from exporters.int8_recipe import choose_recipe
from tests.agent.jobs.conftest import REPO, Device, make_device
from tests.support.registry_server import RegistryServer

LEARN = {"lr": 0.003, "steps": 60}


def worker(state: Path, job_id: str, env: dict[str, str] | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.jobs.worker", "--state-dir", str(state), "--job-id",
         job_id, "--no-parent-check"],
        cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=timeout,
    )


def submit(dev: Device, job_id: str, **over: Any) -> None:
    spec = DeviceJob.model_validate(dev.spec(**over))
    store = JobStore(dev.state)
    store.submit(job_id, "finetune", spec.model_dump(mode="json"))
    store.close()  # the last connection checkpoints the WAL: the db file is settled


def tree_digest(path: Path) -> dict[str, str]:
    """Every file's sha256 and every link's target under ``path``."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def final_weights(state: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(state / "models/digits/current/model.safetensors"))


@dataclass
class CleanRun:
    device: Device
    record: Any
    stages_seen: list[str]
    """The progress row's stage, in the order the polling saw it change."""


@pytest.fixture(scope="module")
def clean_run(device_template: Path, registry: RegistryServer,
              tmp_path_factory: pytest.TempPathFactory) -> CleanRun:
    """One uninterrupted whole job on a fresh device (with upload): the whole-job test checks
    it and the kill -9 test compares its crashed-and-resumed weights with it."""
    dev = make_device(device_template, registry, tmp_path_factory.mktemp("clean"))
    submit(dev, "j1", finetune=LEARN, steps={"upload": True})
    p = subprocess.Popen([sys.executable, "-m", "agent.jobs.worker", "--state-dir",
                          str(dev.state), "--job-id", "j1", "--no-parent-check"], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    store, seen = JobStore(dev.state), []
    while p.poll() is None:
        rec = store.get("j1")
        stage = (rec.progress or {}).get("stage") if rec is not None else None
        if stage and (not seen or seen[-1] != stage):
            seen.append(stage)
        time.sleep(0.05)
    err = p.stderr.read() if p.stderr else ""
    assert p.returncode == 0, err[-3000:]
    rec = store.get("j1")
    store.close()
    return CleanRun(dev, rec, seen)


@pytest.mark.slow
def test_whole_job_commits_an_int8_model_and_uploads_it_signed(clean_run: CleanRun) -> None:
    """Fresh device: pull v1 over HTTP, fine-tune, INT8 export through its gates, stage,
    health against the upstream, commit, upload signed by the device with parent v1."""
    device, rec = clean_run.device, clean_run.record
    assert rec is not None and rec.state is JobState.SUCCEEDED, rec.error
    res = rec.result
    assert res["outcome"] == "committed"
    gain = res["metrics_after"]["eval/acc"] - res["metrics_before"]["eval/acc"]
    assert gain >= 0.20, res["health"]
    assert res["export"]["winner"] == "int8", res["export"]
    # The figures the fleet and the summary read, under these names.
    assert set(res["export"]) == set(EXPORT_FIGURES)
    assert res["export"]["fallback"] is None and res["export"]["excluded_layers"] == []
    # The recipe this host calls for (u8s8-reduce-range on x86 without VNNI), and the slot
    # carries how its file was made, signed with it.
    assert res["export"]["int8_recipe"] == choose_recipe("onnxruntime", detect_isa()).name
    info = json.loads((device.state / "models" / "digits" / "current" / "artefacts"
                       / "model.onnx.json").read_text())
    assert info["int8"]["recipe"] == res["export"]["int8_recipe"] and info["step"] == "int8"
    assert res["export"]["int8_drop_pts"] is not None and res["export"]["p50_ms_b1"] > 0
    # Health scored the staged INT8 file through the runtime that serves it (engine_for: no
    # TensorRT here, so ONNX Runtime on its best provider); the upstream has no ONNX: torch.
    import onnxruntime as ort

    best = "CUDAExecutionProvider" if "CUDAExecutionProvider" in \
        ort.get_available_providers() else "CPUExecutionProvider"
    assert res["health"]["staged"]["runtime"].startswith(f"onnxruntime ({best}"), res["health"]
    assert res["health"]["active"]["runtime"] == "torch"
    mem = res["memory"]
    assert {"peak_tree_mb", "budget_mb", "micro_batch", "accumulation"} <= set(mem), mem
    assert (mem["micro_batch"], mem["accumulation"]) == (64, 1) and mem["peak_tree_mb"] > 0
    assert {"max_temp_c", "target_c", "throttled_s", "state_changes"} <= set(res["governor"])
    assert "report_png" in res  # sensors none: no governor, so no pacing plot (None)
    # Progress named each stage while it ran (never the last fine-tune step during export).
    assert [s for s in clean_run.stages_seen if s in ("finetune", "export", "stage", "health")
            ] == ["finetune", "export", "stage", "health"], clean_run.stages_seen
    from agent.storage.slots import ModelSlots

    active = ModelSlots(device.state, "digits").active()
    assert active is not None and active.version == res["model"]["version"]
    assert (active.path / "artefacts/model.onnx").is_file()
    # The upload: a version the registry serves, signed by the device key, parent v1.
    from registry.pull import fetch_verified_manifest
    from registry.refs import Ref
    from registry.signing import load_trusted_keys
    from registry.stores import open_store
    from registry.transfer import TransferConfig

    up = res["uploaded"]
    assert up["parent"] == "v1"
    device_only = device.root / "device-trusted"
    device_only.mkdir()
    pub = device.state / "trusted_keys/device.pub.pem"
    (device_only / pub.name).write_bytes(pub.read_bytes())
    cfg = TransferConfig()
    got = fetch_verified_manifest(open_store(device.registry.url, cfg),
                                  Ref("digits", up["version"], device.registry.url),
                                  load_trusted_keys(device_only), cfg).manifest
    assert got.parent == "v1" and got.signer.name == "device"
    # Enough for upstream to combine it with the fleet's (signed with it): what it learned
    # from and how it did on this device's held-out data, as counts and figures.
    m, ft = got.training.metrics, {s.name: s for s in JobStore(device.state).steps("j1")}
    ft_out = ft["finetune"].outputs or {}
    assert m["train/samples"] == ft_out["train_samples"] > 0
    assert m["train/steps"] == ft_out["steps"] == rec.spec["finetune"]["steps"]
    assert m["device/held_out_samples"] == ft_out["held_out_samples"] > 0
    assert m["device/acc_before"] == pytest.approx(ft_out["accuracy_before"])
    assert m["device/acc_after"] == pytest.approx(ft_out["accuracy_after"])
    assert m["device/acc"] == pytest.approx(res["metrics_after"]["eval/acc"])  # as served
    assert 0 < m["train/trainable_fraction"] <= 1
    # Upload again (a crash after the registry took it, before the step was recorded): done.
    from agent.jobs.protocol import JobContext
    from agent.jobs.steps import upload

    ctx = JobContext(JobStore(device.state), "j1", device.state,
                     DeviceJob.model_validate(rec.spec))
    ctx.outputs = {s.name: s.outputs or {} for s in JobStore(device.state).steps("j1")}
    again = upload.run(ctx)
    assert again["version"] == up["version"] and again["parent"] == "v1"
    # agentctl jobs / job show it.
    from agent.cli import main

    assert main(["jobs", "--state-dir", str(device.state)]) == 0
    assert main(["job", "j1", "--state-dir", str(device.state)]) == 0


CRASH_POINTS = [
    "inside:pull", "after:pull", "inside:finetune", "after:finetune", "inside:export",
    "after:export", "inside:stage", "after:stage", "inside:health", "after:health",
    "after:commit",
]


@pytest.mark.slow
def test_kill_9_at_every_point_then_restart_finishes_once(device: Device,
                                                          clean_run: CleanRun) -> None:
    """kill -9 of the job process at 11 points (inside each child step, after each step),
    a restart after each: the job finishes exactly once, no finished step runs again, and
    the committed weights equal an uninterrupted run's (atol 1e-5)."""
    from agent.jobs.protocol import CRASH_ENV

    store = JobStore(device.state)
    submit(device, "k1", finetune=LEARN)
    done: dict[str, tuple[float, float]] = {}
    for point in CRASH_POINTS:
        r = worker(device.state, "k1", {CRASH_ENV: point})
        assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-2000:])
        rec = store.get("k1")
        assert rec is not None and rec.state is JobState.IN_PROGRESS, point
        for s in store.steps("k1"):
            if s.name in done:  # a finished step never started again
                assert (s.started_at, s.finished_at) == done[s.name], (point, s.name)
            elif s.status == "done":
                done[s.name] = (s.started_at, s.finished_at)  # type: ignore[assignment]
    r = worker(device.state, "k1")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = store.get("k1")
    assert rec is not None and rec.state is JobState.SUCCEEDED
    assert rec.attempt == len(CRASH_POINTS) + 1
    finished_at = rec.finished_at
    assert worker(device.state, "k1").returncode == 0  # terminal: nothing happens again
    assert store.get("k1").finished_at == finished_at  # type: ignore[union-attr]
    for s in store.steps("k1"):
        if s.name in done:
            assert (s.started_at, s.finished_at) == done[s.name], s.name
    # No temp file of a killed writer is left (the stage's context.json was one).
    assert sorted(p for p in device.state.rglob(".tmp-*")) == []
    crashed = final_weights(device.state)
    # The uninterrupted run: the same job on another fresh device (its upload changes no
    # weight: the specs differ in steps.upload only).
    ref = clean_run.record
    assert {**ref.spec, "steps": None} == {**rec.spec, "steps": None}
    clean = final_weights(clean_run.device.state)
    assert crashed.keys() == clean.keys()
    for k in clean:
        np.testing.assert_allclose(crashed[k], clean[k], atol=1e-5, err_msg=k)


# -- bad input ----------------------------------------------------------------------------


def _agentctl(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", "finetune", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_input_fails_fast_with_exit_2_and_leaves_the_state_dir_unchanged(
    device: Device, tmp_path: Path
) -> None:
    device.install()
    state = device.state
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "cls0").mkdir()
    base = ["--model", "digits", "--state-dir", str(state), "--profile", "generic-x86",
            "--sensors", "none", "--steps", "5", "--job-id", "bad"]
    cases = [
        (["--data", str(tmp_path / "missing")], "--data"),
        (["--data", str(empty)], "--data"),
        (["--data", str(device.data), "--micro-batch", "128", "--effective-batch", "64"],
         "micro_batch"),
        (["--data", str(device.data), "--version", "v9"], "--version"),
    ]
    before = tree_digest(state)
    for extra, names in cases:
        t0 = time.monotonic()
        r = _agentctl([*base, *extra])
        assert r.returncode == 2, (extra, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and names in lines[0], (extra, r.stderr)
        assert time.monotonic() - t0 < 20  # before any probe
        assert tree_digest(state) == before, extra
    # An unreadable installed checkpoint (its manifest garbled).
    manifest = state / "models/digits/current/manifest.json"
    manifest.chmod(0o644)
    manifest.write_text("{not json")
    before = tree_digest(state)
    r = _agentctl([*base, "--data", str(device.data)])
    assert r.returncode == 2 and "--model digits" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert tree_digest(state) == before


def test_an_existing_job_needs_resume_or_a_new_name(device: Device) -> None:
    device.install()
    submit(device, "same", finetune={"steps": 5}, steps={"export": False})
    before = tree_digest(device.state)
    r = _agentctl(["--model", "digits", "--data", str(device.data), "--state-dir",
                   str(device.state), "--job-id", "same"])
    assert r.returncode == 2 and "--resume" in r.stderr, r.stderr
    assert tree_digest(device.state) == before
    r = _agentctl(["--state-dir", str(device.state), "--job-id", "nothing", "--resume"])
    assert r.returncode == 2 and "no job 'nothing'" in r.stderr


def test_sigterm_during_start_up_exits_cleanly(device: Device) -> None:
    device.install()
    for delay in (0.3, 1.5):
        p = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "finetune", "--model", "digits", "--data",
             str(device.data), "--state-dir", str(device.state), "--profile", "generic-x86",
             "--sensors", "none", "--steps", "5", "--job-id", f"t{delay}", "--no-export"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        assert "Traceback" not in err, err
        assert p.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM, 75, 0), (delay, err)
        rec = JobStore(device.state).get(f"t{delay}") if (device.state / "jobs.db").exists() \
            else None
        # Either nothing was made, or the job is stored and resumable (or it finished).
        assert rec is None or rec.state in (JobState.QUEUED, JobState.IN_PROGRESS,
                                            JobState.SUCCEEDED, JobState.FAILED)
        if rec is None:
            assert not (device.state / "jobs" / f"t{delay}").exists()


# -- agentctl finetune (moved from tests/agent/finetune: the command now runs the device job) --


def test_agentctl_finetune_pulls_then_runs_governed_end_to_end(
    device: Device, make_keypair: Any, capsys: pytest.CaptureFixture
) -> None:
    """--version with --registry on a fresh device: a key the device does not trust is
    refused before any chunk (nothing installed or trained); the trusted one pulls, verifies,
    fine-tunes governed by the simulated sensors (micro-batch given) and commits. The report
    and PNG are in the job folder, the outcome carries the governor and the PNG, the summary
    names the temperature; bad flags exit 2, nothing run."""
    import json

    from agent.cli import main

    stranger = make_keypair("stranger")
    argv = ["finetune", "--model", "digits", "--version", "v1", "--registry",
            device.registry.url, "--data", str(device.data), "--state-dir",
            str(device.state), "--profile", "sim", "--sensors", "sim", "--trainable",
            "last_n:2", "--steps", "12", "--micro-batch", "32", "--no-export"]
    # Trusted: the stranger and the device's own key (so the job may start), not upstream.
    shutil.copy(device.state / "trusted_keys" / "device.pub.pem", stranger.trusted_dir)
    assert main([*argv, "--job-id", "p0", "--trusted-keys", str(stranger.trusted_dir)]) == 1
    assert "pull" in capsys.readouterr().err
    assert not (device.state / "models").exists() or not any(
        (device.state / "models").rglob("model.safetensors"))
    assert not (device.state / "jobs/p0/finetune").exists()
    assert main([*argv, "--job-id", "cli1", "--progress", "json"]) == 0
    out, err = capsys.readouterr()
    final = json.loads(out.strip().splitlines()[-1])
    assert final["state"] == "SUCCEEDED" and final["result"]["outcome"] == "committed"
    steps = {s.name: s for s in JobStore(device.state).steps("cli1")}
    assert steps["pull"].outputs["fetched"] is True and steps["pull"].outputs["version"] == "v1"
    assert steps["commit"].status == "done"
    job = device.state / "jobs/cli1/finetune"
    report = json.loads((job / "report.json").read_text())
    assert report["format"] == "edgetrain.job_report/1"
    assert report["job"]["micro_batch_size"] == 32 and report["job"]["steps"] == 12
    assert report["summary"]["max_temp_c"] is not None
    assert (job / "report.png").stat().st_size > 10_000
    res = final["result"]
    assert res["report_png"] == str(job / "report.png")
    gov = res["governor"]
    assert gov["max_temp_c"] == report["summary"]["max_temp_c"] and gov["target_c"] > 0
    assert gov["throttled_s"] >= 0 and gov["state_changes"] >= 0
    assert res["memory"]["micro_batch"] == 32 and res["memory"]["accumulation"] == 2
    assert "max temperature vs target" in err and '"stage": "finetune"' in err
    # Bad input: named flag, exit 2, nothing run. No signing key, or one the device does not
    # trust: refused before anything starts, naming the file and how to make one.
    assert main([*argv, "--job-id", "nokey", "--signing-key",
                 str(device.state / "absent.key.pem")]) == 2
    assert "hpc-train keygen" in capsys.readouterr().err
    assert main([*argv, "--job-id", "nokey", "--signing-key",
                 str(stranger.private_path)]) == 2
    assert "is not in" in capsys.readouterr().err
    assert not (device.state / "jobs/nokey").exists()
    assert main([*argv, "--job-id", "cli2", "--trainable", "some"]) == 2
    assert main([*argv, "--job-id", "cli3", "--profile", "jetson-orin-nano-9gb"]) == 2
    assert not (device.state / "jobs/cli2").exists()
