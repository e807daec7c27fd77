"""One job per state dir, and the A/B slots never lose the rollback target.

Found on devices: two ``agentctl finetune`` started together on one state dir took the same
version name and sequence and both said "committed" while the slot held one job's weights;
a kill while a slot was built dropped the standby (the rollback target) before the new one
was complete; a version staged by a job killed during its health check stayed where
``agentctl rollback`` would activate it. Each test runs the real thing: ``agentctl``
processes on a real state dir (the small CNN and device data the job tests use, a few
fine-tune steps), SIGKILL at points found on the file system or in the job store.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.cli import main as agentctl
from agent.jobs.store import JobState, JobStore
from agent.storage.chunk_store import ChunkStore
from agent.storage.lock import JOB_LOCK, JobLock, job_holder
from agent.storage.slots import ModelSlots, build_version
from agent.storage.update import pull, update
from registry.errors import ChunkHashError, NoStagedVersionError
from registry.refs import parse_ref
from registry.signing import load_trusted_keys
from registry.stores import LocalStore
from tests.agent.jobs.conftest import REPO, Device, build_template, make_device, publish_v1
from tests.support.registry_fixtures import (
    TEST_CHUNK,
    TEST_PACK,
    KeyPair,
    Publisher,
    _build_test_model,
    _make_keypair,
)
from tests.support.registry_serve import fast
from tests.support.registry_server import RegistryServer


@pytest.fixture(scope="module")
def job_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job tests' device (tests/agent/jobs/conftest.py): upstream small CNN, device data,
    keys."""
    return build_template(tmp_path_factory.mktemp("device"))


@pytest.fixture(scope="module")
def job_registry(job_template: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    reg = tmp_path_factory.mktemp("registry")
    publish_v1(job_template, reg)
    with RegistryServer(reg) as server:
        yield server


@pytest.fixture
def dev(job_template: Path, job_registry: RegistryServer, tmp_path: Path) -> Device:
    """A fresh device with the upstream digits@v1 installed (``agentctl pull``)."""
    d = make_device(job_template, job_registry, tmp_path / "dev")
    d.install()
    return d


@dataclass
class Small:
    """The storage tests' small MLP, published by the upstream key to a loopback registry."""

    server: RegistryServer
    publisher: Publisher
    key: KeyPair

    def publish(self, seed: int, version: str, store: Any = None) -> None:
        self.publisher.publish(_build_test_model(seed), version, store=store)


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Small]:
    (tmp_path / "registry").mkdir()
    (tmp_path / "checkpoints").mkdir()
    key = _make_keypair(tmp_path, "upstream")
    with RegistryServer(tmp_path / "registry") as server:
        yield Small(server, Publisher(server.root, tmp_path / "checkpoints", key,
                                      chunk_size=TEST_CHUNK, pack_below=TEST_PACK), key)


JOB = ["--model", "digits", "--profile", "generic-x86", "--sensors", "none", "--trainable",
       "all", "--effective-batch", "16", "--micro-batch", "16", "--no-export",
       "--progress", "json"]
"""A fine-tune of the installed upstream in a few seconds: no export, micro-batch given."""


def finetune(dev: Device, job_id: str, *extra: str, steps: int = 4) -> subprocess.Popen[str]:
    """``agentctl finetune`` in its own session (so a kill takes its children too)."""
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "finetune", *JOB, "--data", str(dev.data),
         "--state-dir", str(dev.state), "--steps", str(steps), "--job-id", job_id, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def resume(dev: Device, job_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "finetune", "--state-dir", str(dev.state),
         "--job-id", job_id, "--resume", "--progress", "json"],
        cwd=REPO, capture_output=True, text=True, timeout=300)


def wait_for(what: Callable[[], Any], why: str, proc: subprocess.Popen[str] | None = None,
             timeout: float = 120) -> Any:
    end = time.monotonic() + timeout
    while not (got := what()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{why}: the process ended first: {proc.communicate()}")
        assert time.monotonic() < end, why
        time.sleep(0.02)
    return got


def step_status(state: Path, job_id: str, step: str) -> str | None:
    if not (state / "jobs.db").exists():
        return None
    steps = {s.name: s.status for s in JobStore(state).steps(job_id)}
    return steps.get(step)


def slot_weights(slot: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(slot / "model.safetensors"))


def job_weights(state: Path, job_id: str) -> dict[str, np.ndarray]:
    """What the job's fine-tune made (its final checkpoint)."""
    from safetensors.numpy import load_file

    return load_file(str(state / "jobs" / job_id / "finetune/checkpoints/final/model.safetensors"))


def same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def ctl(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = agentctl(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- two jobs on one state dir -----------------------------------------------------------------


def test_two_concurrent_finetunes_one_commits_the_other_is_refused_or_waits(
    dev: Device,
) -> None:
    """Two ``agentctl finetune`` started at once: one runs and commits, the other is refused
    at once (exit 5, one line naming the running job, nothing created). A third asking to
    wait (--wait-s) says so, runs once the first has ended and commits its own version, one
    sequence above: the slots hold exactly what each committed job made."""
    state = dev.state
    procs = {j: finetune(dev, j, steps=20) for j in ("race-a", "race-b")}
    # The loser is refused within a second or two; the winner holds the state dir meanwhile.
    loser = wait_for(lambda: next((j for j, p in procs.items() if p.poll() is not None), None),
                     "one of the two ends", timeout=120)
    winner = next(j for j in procs if j != loser)
    out, err = procs[loser].communicate()
    assert procs[loser].returncode == 5, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"another job is running on {state}: job {winner} (pid {procs[winner].pid})" in err
    assert "one job runs per state dir" in err and "--wait-s" in err and "--daemon" in err
    assert JobStore(state).get(loser) is None and not (state / "jobs" / loser).exists()
    assert oct((state / JOB_LOCK).stat().st_mode & 0o777) == "0o600"

    # A third job, told to wait: it waits for the winner, then runs.
    assert procs[winner].poll() is None and job_holder(state) == f"job {winner} " \
        f"(pid {procs[winner].pid})"
    waiter = finetune(dev, "race-c", "--wait-s", "300")
    out, err = procs[winner].communicate(timeout=300)
    assert procs[winner].returncode == 0, err[-3000:]
    won = JobStore(state).get(winner)
    assert won is not None and won.state is JobState.SUCCEEDED
    assert won.result["outcome"] == "committed"  # type: ignore[index]
    _, w_err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, w_err[-3000:]
    assert f"waiting up to 300 s for job {winner}" in w_err, w_err[:2000]

    stage = {j: {s.name: s.outputs for s in JobStore(state).steps(j)}["stage"]
             for j in (winner, "race-c")}
    assert stage[winner]["sequence"] == 2 and stage["race-c"]["sequence"] == 3  # type: ignore[index]
    assert stage[winner]["version"] != stage["race-c"]["version"]  # type: ignore[index]
    slots = ModelSlots(state, "digits")
    active, standby = slots.active(), slots.standby()
    assert active is not None and standby is not None
    assert (active.version, standby.version) == (stage["race-c"]["version"],  # type: ignore[index]
                                                 stage[winner]["version"])  # type: ignore[index]
    assert active.committed and standby.committed
    assert same_weights(slot_weights(active.path), job_weights(state, "race-c"))
    assert same_weights(slot_weights(standby.path), job_weights(state, winner))
    assert not same_weights(slot_weights(active.path), slot_weights(standby.path))
    assert job_holder(state) is None


def test_the_daemon_queue_waits_for_a_job_running_in_the_foreground(
    two_installed: tuple[Path, Any], small: Small, caplog: pytest.LogCaptureFixture,
) -> None:
    """While a foreground job holds the state dir (its job lock), the daemon's runner starts
    no worker: its next job stays QUEUED, untouched, and runs once the lock is free. A worker
    started anyway (the lock taken between the runner's look and the start) exits 5 and
    leaves its job as it was."""
    from agent.daemon.announce import Announcer
    from agent.daemon.config import LimitsConfig
    from agent.daemon.runner import JobRunner
    from agent.mqtt.outbox import Outbox
    from contract import Topics

    state, _ = two_installed
    store = JobStore(state)
    spec = {"name": "digits", "trusted_keys": str(small.key.trusted_dir)}
    store.submit("rb1", "rollback", spec)
    with JobLock(state, "foreground"):
        r = subprocess.run([sys.executable, "-m", "agent.jobs.worker", f"--state-dir={state}",
                            "--job-id=rb1", "--no-parent-check"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 5, r.stderr
        assert f"another job is running on {state}: job foreground (pid {os.getpid()})" \
            in r.stderr
        rec = store.get("rb1")
        assert rec is not None and rec.state is JobState.QUEUED and rec.attempt == 0
        assert store.steps("rb1") == []

        runner = JobRunner(store, Announcer(Outbox(state), Topics(), "dev-a", lambda: None),
                           state, LimitsConfig())
        with caplog.at_level(logging.INFO, logger="agent.daemon.runner"):
            runner.start()
            try:
                wait_for(lambda: "busy with job foreground" in caplog.text,
                         "the runner sees the state dir busy")
                assert store.get("rb1").state is JobState.QUEUED  # type: ignore[union-attr]
                assert not (state / "logs" / "rb1.log").exists()  # no worker started
            except BaseException:
                runner.stop()
                raise
    try:
        done = wait_for(lambda: (r := store.get("rb1")) is not None and r.terminal and r,
                        "the queued job runs once the lock is free")
        assert done.state is JobState.SUCCEEDED, done.error
        assert ModelSlots(state, "digits").active().version == "1"  # type: ignore[union-attr]
    finally:
        runner.stop()


# -- a kill while the slot is built ------------------------------------------------------------

BUILD = """
import sys
from pathlib import Path
from agent.storage.chunk_store import ChunkStore
from agent.storage.slots import ModelSlots, build_version
from registry.signing import load_trusted_keys, verify_signed_manifest
state, manifest, signature, trusted = map(Path, sys.argv[1:])
m, key = verify_signed_manifest(manifest.read_bytes(), signature.read_bytes(),
                                load_trusted_keys(trusted))
ModelSlots(state, m.name).stage(m, manifest.read_bytes(), signature.read_bytes(),
                                ChunkStore(state), key)
"""


@pytest.fixture
def two_installed(small: Small, tmp_path: Path) -> tuple[Path, Any]:
    """A state dir with digits@1 committed then digits@2 (active; 1 is the rollback target),
    and digits@3 in the registry, its chunks fetched but nothing staged. Returns the state dir
    and digits@3's pull."""
    for version, seed in (("1", 0), ("2", 1), ("3", 2)):
        small.publish(seed, version)
    state, keys = tmp_path / "state", load_trusted_keys(small.key.trusted_dir)
    for version in ("1", "2"):
        update(parse_ref(f"digits@{version}", small.server.url), state_dir=state,
               trusted=keys, cfg=fast())
    slots = ModelSlots(state, "digits")
    assert slots.active().version == "2"  # type: ignore[union-attr]
    assert slots.standby().version == "1" and slots.standby().committed  # type: ignore[union-attr]
    pulled = pull(parse_ref("digits@3", small.server.url), state_dir=state, trusted=keys,
                  cfg=fast())
    return state, pulled


def rollback_target_intact(state: Path, trusted: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """``agentctl rollback`` activates the committed digits@1 (re-verified, every tensor):
    the rollback target survived."""
    slots = ModelSlots(state, "digits")
    code, out, err = ctl("rollback", "digits", "--state-dir", str(state), "--trusted-keys",
                         str(trusted), capsys=capsys)
    assert code == 0 and "rolled back: digits@1 active" in out, err
    active = slots.active()
    assert active is not None and active.version == "1" and active.committed


def test_sigkill_in_the_middle_of_a_slot_build_keeps_the_rollback_target(
    two_installed: tuple[Path, Any], small: Small, subprocess_env: dict[str, str],
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """digits@3 is staged by a process that is SIGKILLed half-way through writing the new
    slot. The seam, found on the file system: the last chunk of digits@3 is a named pipe, so
    the build blocks reading it once every other chunk is written; a pipe opened for writing
    without blocking succeeds exactly when the builder has it open."""
    state, pulled = two_installed
    v = pulled.verified
    (tmp_path / "m.json").write_bytes(v.manifest_bytes)
    (tmp_path / "m.sig").write_bytes(v.signature_bytes)
    last = ChunkStore(state).path(v.manifest.chunks[-1].sha256)
    last.unlink()
    os.mkfifo(last)
    p = subprocess.Popen([sys.executable, "-c", BUILD, str(state), str(tmp_path / "m.json"),
                          str(tmp_path / "m.sig"), str(small.key.trusted_dir)],
                         env=subprocess_env, cwd=REPO, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)

    def builder_reads_it() -> int | None:
        try:
            return os.open(last, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody has it open for reading yet
            return None

    fd = wait_for(builder_reads_it, "the build reaches the last chunk", p)
    try:
        building = sorted((state / "models/digits/slots").glob(".new-*"))
        assert len(building) == 1 and (building[0] / "model.safetensors").stat().st_size > 0
        os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL
    finally:
        os.close(fd)
    standby = ModelSlots(state, "digits").standby()
    assert standby is not None and standby.version == "1" and standby.committed
    rollback_target_intact(state, small.key.trusted_dir, capsys)

    # The next stage cleans what the killed one left and installs digits@3 whole.
    last.unlink()
    update(parse_ref("digits@3", small.server.url), state_dir=state,
           trusted=load_trusted_keys(small.key.trusted_dir), cfg=fast())
    slots = ModelSlots(state, "digits")
    assert slots.active().version == "3"  # type: ignore[union-attr]
    assert sorted(p.name for p in (state / "models/digits/slots").iterdir()) == ["a", "b"]


def test_a_failure_mid_build_or_between_the_renames_keeps_the_rollback_target(
    two_installed: tuple[Path, Any], small: Small, capsys: pytest.CaptureFixture[str],
) -> None:
    """A real error half-way through the copy (a chunk that rotted on disk: its hash check
    fails after the chunks before it were written), then a stage stopped between setting the
    old standby aside and renaming the new slot in: the rollback target survives both."""
    state, pulled = two_installed
    v = pulled.verified
    slots = ModelSlots(state, "digits")
    last = ChunkStore(state).path(v.manifest.chunks[-1].sha256)
    good = last.read_bytes()
    last.write_bytes(b"\0" * len(good))
    with pytest.raises(ChunkHashError):
        slots.stage(v.manifest, v.manifest_bytes, v.signature_bytes, ChunkStore(state), v.key)
    assert not list((state / "models/digits/slots").glob(".new-*"))  # the half build is gone
    assert slots.standby().version == "1"  # type: ignore[union-attr]

    # Stopped between the two renames: digits@3 complete under its temporary name, the
    # standby (digits@1) set aside, no slot under its name (a power cut there). The next
    # rollback puts the standby back first.
    last.write_bytes(good)
    slots_dir = state / "models/digits/slots"
    target = slots.standby()
    assert target is not None
    build_version(v.manifest, v.manifest_bytes, v.signature_bytes, ChunkStore(state), v.key,
                  slots_dir / f".new-{target.slot}-cafe0002")
    os.rename(target.path, slots_dir / f".old-{target.slot}-cafe0001")
    assert slots.standby() is None
    rollback_target_intact(state, small.key.trusted_dir, capsys)
    # The next stage leaves nothing of the interrupted one.
    slots.stage(v.manifest, v.manifest_bytes, v.signature_bytes, ChunkStore(state), v.key)
    assert sorted(p.name for p in slots_dir.iterdir()) == ["a", "b"]


# -- a job killed during its health check ------------------------------------------------------


def test_a_job_killed_during_health_is_never_rolled_back_to(
    dev: Device, capsys: pytest.CaptureFixture[str],
) -> None:
    """ft-1 is SIGKILLed during its health check: its staged version stays in the standby
    slot for it to resume, but ``agentctl rollback`` refuses it and names the active version
    as the last committed one. ft-2 is killed there too, replacing ft-1's staged version:
    ft-1 resumed ends FAILED with its summary (its version is gone), ft-2 resumed commits its
    own weights, and a rollback then goes back to the upstream, the last committed before."""
    state = dev.state

    def killed_in_health(job_id: str) -> None:
        p = finetune(dev, job_id)
        wait_for(lambda: step_status(state, job_id, "health") == "running",
                 f"{job_id} reaches its health check", p)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)

    killed_in_health("ft-1")
    slots = ModelSlots(state, "digits")
    staged = slots.standby()
    assert staged is not None and not staged.committed
    assert staged.version == {s.name: s.outputs for s in JobStore(state).steps("ft-1")}[
        "stage"]["version"]  # type: ignore[index]
    code, out, err = ctl("rollback", "digits", "--state-dir", str(state), capsys=capsys)
    assert code == 2, (out, err)
    assert f"the standby slot holds {staged.version}, staged by a job that never committed" \
        in err and "v1, the active version, is the last committed one" in err, err
    assert slots.active().version == "v1"  # type: ignore[union-attr]

    killed_in_health("ft-2")
    r = resume(dev, "ft-1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    rec = JobStore(state).get("ft-1")
    assert rec is not None and rec.state is JobState.FAILED
    assert "no longer in the standby slot" in rec.error["message"]  # type: ignore[index]
    assert "ft-1 (finetune) FAILED" in r.stderr, r.stderr[-3000:]  # its summary, as any end
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["state"] == "FAILED" and summary["error"]["code"] == "JOB_FAILED"

    r = resume(dev, "ft-2")
    assert r.returncode == 0, r.stderr[-3000:]
    active = slots.active()
    assert active is not None and active.committed
    assert same_weights(slot_weights(active.path), job_weights(state, "ft-2"))
    code, out, err = ctl("rollback", "digits", "--state-dir", str(state), capsys=capsys)
    assert code == 0 and "rolled back: digits@v1 active" in out, err


def test_commit_takes_only_the_version_it_staged(small: Small, tmp_path: Path) -> None:
    """Two registries each hold a digits@2 with other weights: staged from one, replaced by
    the other under the same name, the commit of the first one's digest is refused."""
    other = LocalStore(tmp_path / "other")
    for seed, version, store in ((0, "1", None), (1, "2", None), (0, "1", other),
                                 (2, "2", other)):
        small.publish(seed, version, store=store)
    state, keys = tmp_path / "state", load_trusted_keys(small.key.trusted_dir)
    update(parse_ref("digits@1", small.server.url), state_dir=state, trusted=keys, cfg=fast())
    slots = ModelSlots(state, "digits")

    def stage_from(url: str) -> Any:
        v = pull(parse_ref("digits@2", url), state_dir=state, trusted=keys, cfg=fast()).verified
        return slots.stage(v.manifest, v.manifest_bytes, v.signature_bytes, ChunkStore(state),
                           v.key)

    mine = stage_from(small.server.url)
    theirs = stage_from(other.uri)
    assert mine.version == theirs.version and mine.manifest_sha256 != theirs.manifest_sha256
    with pytest.raises(NoStagedVersionError, match="not the version staged for this commit"):
        slots.commit("2", manifest_sha256=mine.manifest_sha256)
    assert slots.active().version == "1"  # type: ignore[union-attr]
    slots.commit("2", manifest_sha256=theirs.manifest_sha256)
    assert slots.active().manifest_sha256 == theirs.manifest_sha256  # type: ignore[union-attr]
