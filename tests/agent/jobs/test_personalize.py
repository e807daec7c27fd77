"""Personalized serving: a deploy with ``personal`` takes the fleet's release with the parts of
the device's own model named kept in place, and the device signs the result as its own version
of the release (lineage: the release), staged, health-checked and committed like a fine-tune. A
device with nothing of its own takes the release as published."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from agent.jobs.resolve import DeviceSettings, resolve
from agent.jobs.spec import DeployArgs
from agent.jobs.store import JobState, JobStore
from agent.storage.slots import ModelSlots
from tests.agent.jobs.conftest import Device, make_device, publish_v1
from tests.agent.jobs.test_device_job import submit, worker
from tests.support.registry_server import RegistryServer

TINY = {"finetune": {"steps": 4}, "steps": {"export": False, "upload": False},
        "health": {"max_accuracy_drop_pts": 100.0}}
"""A four-step fine-tune whose version commits: the device's own model."""


@pytest.fixture
def fleet_registry(device_template: Path, tmp_path: Path) -> Iterator[RegistryServer]:
    """digits@v1 and the fleet's next release digits@v2 (v1's weights moved, as a round's
    aggregate moves them), both signed by the upstream key."""
    from hpc_core.model_spec import read_checkpoint
    from registry.publish import VersionContent, publish_content
    from registry.safetensors_io import read_safetensors_index
    from registry.signing import load_signing_key
    from registry.stores import LocalStore

    reg = tmp_path / "registry"
    publish_v1(device_template, reg)
    v1 = read_checkpoint(device_template / "up")
    weights = load_file(str(v1.path / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    moved = tmp_path / "v2"
    moved.mkdir()
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point()
               else v for k, v in weights.items()}, str(moved / "model.safetensors"))
    content = VersionContent(moved, v1.model, v1.training,
                             read_safetensors_index(moved / "model.safetensors"), v1.layout)
    key = load_signing_key(Path((device_template / "upstream.key").read_text()))
    publish_content(content, LocalStore(reg), name="digits", version="v2", key=key,
                    parent="v1")
    with RegistryServer(reg) as server:
        yield server


def _job(dev: Device, job_id: str, type_: str, spec: dict[str, Any]) -> tuple[Any, dict]:
    store = JobStore(dev.state)
    store.submit(job_id, type_, spec)
    store.close()
    r = worker(dev.state, job_id)
    store = JobStore(dev.state)
    rec, steps = store.get(job_id), {s.name: s.outputs for s in store.steps(job_id)}
    store.close()
    assert r.returncode == 0 and rec is not None, r.stderr[-2000:]
    return rec, steps


def _deploy_v2(dev: Device) -> dict[str, Any]:
    return {"model": "digits", "version": "v2", "registry": dev.registry.url,
            "data": str(dev.data), "personal": ["head", "norm"],
            "health": {"max_accuracy_drop_pts": 100.0}}


@pytest.mark.slow
def test_a_personalized_deploy_keeps_the_devices_own_parts_and_signs_its_own_version(
    device_template: Path, fleet_registry: RegistryServer, tmp_path: Path,
) -> None:
    dev = make_device(device_template, fleet_registry, tmp_path / "dev")
    dev.install()  # v1
    submit(dev, "own", **TINY)
    assert worker(dev.state, "own").returncode == 0
    slots = ModelSlots(dev.state, "digits")
    own = slots.active()
    assert own is not None and own.manifest.base_release.version == "v1"

    rec, steps = _job(dev, "p", "deploy", _deploy_v2(dev))
    assert rec.state is JobState.SUCCEEDED, rec.error
    assert list(steps) == ["pull", "personalize", "stage", "health", "commit"]
    # The release was only made from (the job's folder), never staged as it is.
    assert steps["pull"]["training_source"] is True and steps["pull"]["version"] == "v2"
    made = steps["personalize"]
    assert made["personalized"] is True and made["parts"] == ["head", "norm"]
    assert made["own_version"] == own.version
    # The device's own version of v2: signed with its key, lineage v2, the parts recorded.
    active = slots.active()
    assert active is not None and active.version == steps["stage"]["version"]
    m = active.manifest
    assert m.parent == "v2" and m.base_release.version == "v2"
    assert m.signer.name == steps["stage"]["signer"] != "upstream"
    assert m.sequence > own.manifest.sequence
    assert m.training.personal is not None
    assert m.training.personal.parts == ("head", "norm")
    assert m.training.personal.own_version == own.version
    assert m.training.metrics == {}  # v2's figures do not describe these weights
    assert slots.standby().version == own.version  # the rollback target is the device's own
    # Its tensors: the own model's head and normalization, v2's everywhere else.
    got = load_file(str(active.path / "model.safetensors"))
    mine = load_file(str(own.path / "model.safetensors"))
    v2 = load_file(str(tmp_path / "v2" / "model.safetensors"))
    from agent.finetune.personal import personal_keys
    from hpc_core.model_spec import build_module

    personal = personal_keys(build_module(m.model), ["head", "norm"])
    assert personal and personal < set(got)
    for k, t in got.items():
        assert torch.equal(t, mine[k] if k in personal else v2[k]), k
    assert not all(torch.equal(mine[k], v2[k]) for k in personal)  # the parts did differ
    # The health check ran the staged version on the device's data.
    assert steps["health"]["passed"] is True
    # Anti-rollback by lineage holds for it: v1 personalized is a version of an older
    # release than the one now committed, refused at stage with the models untouched.
    from tests.agent.jobs.test_device_job import tree_digest

    before = tree_digest(dev.state / "models")
    rec, steps = _job(dev, "old", "deploy", {**_deploy_v2(dev), "version": "v1"})
    assert rec.state is JobState.FAILED and "DowngradeError" in rec.error["message"], rec.error
    assert "commit" not in steps and tree_digest(dev.state / "models") == before


@pytest.mark.slow
def test_a_device_with_nothing_of_its_own_takes_the_release_as_published(
    device_template: Path, fleet_registry: RegistryServer, tmp_path: Path,
) -> None:
    dev = make_device(device_template, fleet_registry, tmp_path / "fresh")
    rec, steps = _job(dev, "p", "deploy", _deploy_v2(dev))
    assert rec.state is JobState.SUCCEEDED, rec.error
    made = steps["personalize"]
    assert made["personalized"] is False and made["reason"] == "no model of its own yet"
    assert steps["pull"].get("training_source") is None  # staged as published
    active = ModelSlots(dev.state, "digits").active()
    assert active is not None and active.version == "v2"
    assert active.manifest.signer.name == "upstream" and active.manifest.training.personal is None


def test_deploy_args_name_known_parts_and_the_daemon_passes_them_on(tmp_path: Path) -> None:
    args = DeployArgs(model="digits", version="v2", personal=["head"])
    settings = DeviceSettings(
        state_dir=tmp_path, data_root=tmp_path, registry="http://127.0.0.1:1",
        upload_registry=None, trusted_keys=tmp_path / "keys", signing_key=tmp_path / "k.pem")
    job = resolve("deploy", args, settings)
    assert job.personal == ["head"] and job.skipped_steps() == set()  # type: ignore[attr-defined]
    plain = resolve("deploy", DeployArgs(model="digits", version="v2"), settings)
    assert plain.skipped_steps() == {"personalize"}  # type: ignore[attr-defined]
    for bad in (["tail"], ["head", "norm", "head"], "head"):
        with pytest.raises(ValidationError, match="personal"):
            DeployArgs.model_validate({"model": "digits", "version": "v2", "personal": bad})



@pytest.mark.slow
def test_a_personalized_version_signed_by_another_key_is_refused_and_nothing_changes(
    device_template: Path, fleet_registry: RegistryServer, tmp_path: Path,
) -> None:
    from registry.signing import generate_keypair
    from tests.agent.jobs.test_device_job import tree_digest

    dev = make_device(device_template, fleet_registry, tmp_path / "dev")
    dev.install()
    submit(dev, "own", **TINY)
    assert worker(dev.state, "own").returncode == 0
    own = ModelSlots(dev.state, "digits").active()
    # The key the job signs with is not the one the device trusts under that name: another
    # key's signature, as a version made elsewhere and passed off as the device's would carry.
    other, _ = generate_keypair(tmp_path / "other", "device")
    (dev.state / "device.key.pem").write_bytes(other.read_bytes())
    before = tree_digest(dev.state / "models")
    rec, steps = _job(dev, "p", "deploy", _deploy_v2(dev))
    assert rec.state is JobState.FAILED, rec
    assert "stage" in rec.error["message"] and "not trusted here" in rec.error["message"], \
        rec.error
    assert "commit" not in steps and "health" not in steps
    assert tree_digest(dev.state / "models") == before
    assert ModelSlots(dev.state, "digits").active().version == own.version
