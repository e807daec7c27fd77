"""``data: spool``: a command resolves it to the model's spool under data_root, the fine-tune
trains on a snapshot taken into the job's folder, and the version it makes (staged and
uploaded) names that snapshot in its signed manifest; a spool too small is refused."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.finetune.job import min_samples
from agent.jobs.preflight import check_inputs
from agent.jobs.resolve import ArgsRefused, DeviceSettings, resolve
from agent.jobs.spec import DeployArgs, DeviceJob, FinetuneArgs
from agent.jobs.store import JobState, JobStore
from agent.spool.config import SpoolConfig, spool_dir
from agent.spool.index import count_kept
from agent.spool.lineage import data_set_record
from agent.spool.store import Spool
from registry.manifest import Manifest, TrainingData, TrainingInfo
from tests.agent.jobs.conftest import REPO, Device, build_template, make_device, publish_v1
from tests.support.registry_server import RegistryServer

SHA = "ab" * 32


def settings(root: Path) -> DeviceSettings:
    return DeviceSettings(state_dir=root / "state", data_root=root / "data", registry=None,
                          upload_registry=None, trusted_keys=root / "keys",
                          signing_key=root / "device.key.pem")


# -- resolution and the record, no training ---------------------------------------------------


def test_data_spool_resolves_to_the_model_s_spool_and_nowhere_else(tmp_path: Path) -> None:
    s = settings(tmp_path)
    (s.data_root / "cam0").mkdir(parents=True)
    args = FinetuneArgs(model="digits", data="spool")
    with pytest.raises(ArgsRefused) as e:
        resolve("finetune", args, s)
    assert e.value.field == "data" and "no spool for digits" in str(e.value)
    Spool(s.spool("digits"), SpoolConfig()).close()
    # Found, but empty: refused at once, not after the pull (64 + its held-out 30% = 91).
    with pytest.raises(ArgsRefused) as e:
        resolve("finetune", args, s)
    assert e.value.field == "data" and "holds 0 labelled samples" in str(e.value)
    assert "at least 91" in str(e.value)
    record_random(s.spool("digits"), 91)
    job = resolve("finetune", args, s)
    assert isinstance(job, DeviceJob)
    assert job.data == spool_dir(s.data_root.resolve(), "digits") == s.data_root.resolve() / \
        "spool" / "digits"
    # Another model's spool is not this one's, and a deploy cannot name the spools' folder.
    with pytest.raises(ArgsRefused, match="no spool for other"):
        resolve("finetune", FinetuneArgs(model="other", data="spool"), s)
    with pytest.raises(ArgsRefused, match="only a finetune"):
        resolve("deploy", DeployArgs(model="digits", version="v2", data="spool"),
                settings(tmp_path).model_copy(update={"registry": "http://r"}))
    assert resolve("finetune", FinetuneArgs(model="digits", data="cam0"), s).data == \
        s.data_root.resolve() / "cam0"  # type: ignore[attr-defined]


def record_random(root: Path, n: int, config: SpoolConfig | None = None) -> None:
    rng = np.random.default_rng(0)
    with Spool(root, config or SpoolConfig()) as spool:
        for i in range(n):
            spool.record(rng.random((1, 8, 8), dtype=np.float32), label=i % 10)


def test_the_submission_count_is_the_spool_s_own_after_evictions(tmp_path: Path) -> None:
    # Two of each class, then 60 of class 0 over a cap of 12: the first segment keeps 18 of
    # its 20 rows (2 evicted: dead rows), whole later segments go. The count read without
    # the lock agrees with the spool's own and with its snapshot.
    root = tmp_path / "spool"
    rng = np.random.default_rng(0)
    with Spool(root, SpoolConfig(per_class_cap=12)) as spool:
        spool.record(rng.random((20, 1, 8, 8), dtype=np.float32), label=np.arange(20) % 10)
        for _ in range(3):
            spool.record(rng.random((20, 1, 8, 8), dtype=np.float32),
                         label=np.zeros(20, np.int64))
        kept = spool.stats().samples
        snap = spool.snapshot(tmp_path / "snap.npz")
    assert json.loads((root / "dead.json").read_text())["dead"], "no partly evicted segment"
    assert kept == 30 == count_kept(root) == snap.samples
    # A sample of another shape is dropped by the spool, and not counted.
    with Spool.open(root) as spool:
        assert spool.record(np.zeros((1, 16, 16), np.float32), label=3) == 0
    assert count_kept(root) == 30
    assert count_kept(tmp_path) == 0  # no segments at all


def test_a_spool_that_leads_out_of_data_root_is_refused(tmp_path: Path) -> None:
    s = settings(tmp_path)
    outside = tmp_path / "elsewhere"
    Spool(outside, SpoolConfig()).close()
    (s.data_root / "spool").mkdir(parents=True)
    os.symlink(outside, s.data_root / "spool" / "digits")
    with pytest.raises(ArgsRefused, match="leads out of data_root"):
        resolve("finetune", FinetuneArgs(model="digits", data="spool"), s)


def test_min_samples_is_what_the_held_out_split_leaves_one_step() -> None:
    assert min_samples(64, 0.3) == 91  # 91 - round(27.3) = 64; 90 - 27 = 63
    assert min_samples(1, 0.5) == 2


def test_a_data_set_is_named_by_its_content(tmp_path: Path) -> None:
    np.savez(tmp_path / "cam0.npz", x=np.zeros((5, 1, 4, 4), np.float32), y=np.arange(5))
    rec = data_set_record(tmp_path / "cam0.npz")
    assert rec.samples == 5 and rec.source == "data_set" and rec.name == "cam0.npz"
    assert rec.sha256 == hashlib.sha256((tmp_path / "cam0.npz").read_bytes()).hexdigest()
    for cls, files in (("a", ["1.png", "2.png", "notes.txt"]), ("b", ["3.jpg"])):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for f in files:
            (tmp_path / "imgs" / cls / f).write_bytes(f.encode())
    first = data_set_record(tmp_path / "imgs")
    assert first.samples == 3
    (tmp_path / "imgs" / "b" / "3.jpg").write_bytes(b"changed")
    assert data_set_record(tmp_path / "imgs").sha256 != first.sha256


def test_the_manifest_data_record_is_optional_and_signed_when_set(tmp_path: Path) -> None:
    from tests.support.manifests import manifest_for, model_state

    m, _ = manifest_for(tmp_path / "m.safetensors", model_state())
    assert "data" not in json.loads(m.to_bytes())["training"]  # old readers take it
    rec = TrainingData(source="spool", name="digits", sha256=SHA, samples=120,
                       pseudo_labelled=20)
    with_data = m.model_copy(update={"training": TrainingInfo(data=rec)})
    doc = json.loads(with_data.to_bytes())
    assert doc["training"]["data"] == {"source": "spool", "name": "digits", "sha256": SHA,
                                       "samples": 120, "pseudo_labelled": 20}
    assert Manifest.from_bytes(with_data.to_bytes()).training.data == rec
    for bad in ({"name": "../x"}, {"pseudo_labelled": 121}, {"sha256": "zz"}):
        with pytest.raises(ValueError):
            TrainingData.model_validate({**rec.model_dump(), **bad})


# -- the whole device job on a spool ------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_template(tmp_path_factory.mktemp("device"))


@pytest.fixture(scope="module")
def registry(template: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[RegistryServer]:
    reg = tmp_path_factory.mktemp("registry")
    publish_v1(template, reg)
    with RegistryServer(reg) as server:
        yield server


def fill_spool(root: Path, data: Path, samples: int) -> None:
    """The device's data recorded as an application would: labelled samples with the
    model's logits, and a fifth unlabelled, pseudo-labelled where the model was sure."""
    with np.load(data, allow_pickle=False) as z:
        x, y = z["x"][:samples].astype(np.float32), z["y"][:samples].astype(np.int64)
    if x.ndim == 3:
        x = x[:, None]
    logits = np.eye(10)[y] * 6.0  # a model that is sure, and right
    with Spool(root, SpoolConfig(pseudo_label_threshold=0.9)) as spool:
        for i in range(len(y)):
            if i % 5 == 0:
                spool.record(x[i], logits=logits[i])
            else:
                spool.record(x[i], label=int(y[i]), logits=logits[i])


def run_job(dev: Device, job_id: str, **over: object) -> object:
    store = JobStore(dev.state)
    spec = DeviceJob.model_validate(dev.spec(**over))
    store.submit(job_id, "finetune", spec.model_dump(mode="json"))
    store.close()
    p = subprocess.run(
        [sys.executable, "-m", "agent.jobs.worker", "--state-dir", str(dev.state),
         "--job-id", job_id, "--no-parent-check"], cwd=REPO, capture_output=True, text=True,
        timeout=600, env={**os.environ})
    store = JobStore(dev.state)
    rec = store.get(job_id)
    store.close()
    assert rec is not None, p.stderr[-3000:]
    return rec


@pytest.mark.slow
def test_a_fine_tune_from_the_spool_names_its_snapshot_in_the_signed_manifest(
        template: Path, registry: RegistryServer, tmp_path: Path) -> None:
    dev = make_device(template, registry, tmp_path / "dev")
    spool = tmp_path / "data" / "spool" / "digits"
    fill_spool(spool, dev.data, 300)
    rec = run_job(dev, "s1", data=str(spool), steps={"export": False, "upload": True},
                  health={"max_accuracy_drop_pts": 100.0})
    assert rec.state == JobState.SUCCEEDED, rec.error  # type: ignore[attr-defined]
    snap = dev.state / "jobs" / "s1" / "spool.npz"
    sha = hashlib.sha256(snap.read_bytes()).hexdigest()
    with np.load(snap, allow_pickle=False) as z:
        samples, pseudo = len(z["y"]), int(z["pseudo"].sum())
    assert samples == 300 and 0 < pseudo <= 60
    steps = {s.name: s.outputs for s in JobStore(dev.state).steps("s1")}
    assert steps["finetune"]["data"] == {"source": "spool", "name": "digits", "sha256": sha,
                                         "samples": samples, "pseudo_labelled": pseudo}
    # The fine-tune read the snapshot, not the spool that goes on recording.
    setup = json.loads((dev.state / "jobs" / "s1" / "setup.json").read_text())
    assert setup["config"]["data"]["path"] == str(snap)
    want = TrainingData(source="spool", name="digits", sha256=sha, samples=samples,
                        pseudo_labelled=pseudo)
    from agent.storage.slots import ModelSlots

    staged = ModelSlots(dev.state, "digits").installed(steps["stage"]["version"])
    assert staged.manifest.training.data == want
    uploaded = registry.root / "digits" / steps["upload"]["version"] / "manifest.json"
    assert Manifest.from_bytes(uploaded.read_bytes()).training.data == want


def test_a_spool_too_small_for_one_step_is_refused_naming_the_field(
        template: Path, registry: RegistryServer, tmp_path: Path) -> None:
    dev = make_device(template, registry, tmp_path / "dev")
    spool = tmp_path / "data" / "spool" / "digits"
    fill_spool(spool, dev.data, 40)
    # agentctl finetune refuses it before anything is created (the daemon's commands in
    # resolve, above); a job stored anyway is refused by its fine-tune step.
    with pytest.raises(ValueError, match=f"--data: the spool {spool} holds 40 labelled") as e:
        check_inputs(DeviceJob.model_validate(dev.spec(data=str(spool))))
    assert "at least 91" in str(e.value)
    rec = run_job(dev, "s2", data=str(spool), steps={"export": False})
    assert rec.state == JobState.FAILED  # type: ignore[attr-defined]
    msg = json.dumps(rec.error)  # type: ignore[attr-defined]
    assert "data: the spool" in msg and "holds 40 labelled samples" in msg
    assert "at least 91" in msg and "finetune.effective_batch" in msg
    assert not (dev.state / "jobs" / "s2" / "finetune").exists()
