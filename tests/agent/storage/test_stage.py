"""stage / commit / discard_staged, and staging a version the device fine-tuned and signed."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.finetune.active import load_active
from agent.storage.slots import ModelSlots
from agent.storage.update import stage_local, update
from hpc_core.model_spec import read_checkpoint
from registry.errors import KeyScopeError, NoStagedVersionError, UnknownKeyError
from registry.refs import parse_ref
from registry.signing import load_trusted_keys
from registry.transfer import TransferConfig
from tests.support.registry_fixtures import TEST_MODEL, _save_model_checkpoint


@pytest.fixture
def installed(new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
              fast_transfers: TransferConfig, tmp_path: Path) -> Path:
    publisher.publish(new_model(), "1")
    state = tmp_path / "state"
    update(parse_ref("digits@1", registry_server.url), state_dir=state,
           trusted=load_trusted_keys(upstream_key.trusted_dir), cfg=fast_transfers)
    return state


def tuned_checkpoint(model: torch.nn.Module, where: Path) -> tuple[torch.nn.Module, Path]:
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned[-1].weight.mul_(0.5)  # the head, as a fine-tune with the body frozen
    return tuned, _save_model_checkpoint(where, tuned, TEST_MODEL)


def test_stage_then_commit_or_discard_a_locally_fine_tuned_version(
    new_model: Any, installed: Path, upstream_key: Any, make_keypair: Any, tmp_path: Path,
) -> None:
    device = make_keypair("jetson-07")
    trusted = tmp_path / "trusted"
    shutil.copytree(upstream_key.trusted_dir, trusted)
    shutil.copy(device.public_path, trusted / device.public_path.name)
    (trusted / "jetson-07.scope").write_text("digits@*+jetson-07.*\n")
    keys = load_trusted_keys(trusted)
    tuned, ckpt = tuned_checkpoint(new_model(), tmp_path / "ft")
    slots = ModelSlots(installed, "digits")
    parent = slots.installed()

    staged = stage_local(read_checkpoint(ckpt), state_dir=installed, parent=parent,
                         version="1+jetson-07.a", key=device.signing, trusted=keys)
    assert staged.verified_by == f"jetson-07 ({device.signing.key_id})"
    assert staged.manifest.sequence == 2 and staged.manifest.parent == "1"
    assert slots.active().version == "1"  # type: ignore[union-attr]  # current untouched
    with pytest.raises(NoStagedVersionError):
        slots.commit("1+jetson-07.other")

    # The gates failed: discard. The active version and the rollback story are as before.
    slots.discard_staged()
    assert slots.standby() is None and slots.active().version == "1"  # type: ignore[union-attr]

    # Staged again and committed: the fine-tuned weights are active, the parent is standby.
    stage_local(read_checkpoint(ckpt), state_dir=installed, parent=parent,
                version="1+jetson-07.b", key=device.signing, trusted=keys)
    switch = slots.commit("1+jetson-07.b")
    assert switch.previous is not None and switch.previous.version == "1"
    assert slots.highest_sequence() == 2
    loaded = load_active(installed, "digits", trusted=keys, verify=True)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded.module(x), tuned.eval()(x))


def test_a_local_version_must_verify_under_the_device_keys_scope(
    new_model: Any, installed: Path, upstream_key: Any, make_keypair: Any, tmp_path: Path,
) -> None:
    device = make_keypair("jetson-07")
    _, ckpt = tuned_checkpoint(new_model(), tmp_path / "ft")
    parent = ModelSlots(installed, "digits").installed()
    content = read_checkpoint(ckpt)
    with pytest.raises(UnknownKeyError):  # the device key is not trusted at all
        stage_local(content, state_dir=installed, parent=parent, version="1+jetson-07.a",
                    key=device.signing, trusted=load_trusted_keys(upstream_key.trusted_dir))
    trusted = tmp_path / "trusted"
    shutil.copytree(device.trusted_dir, trusted)
    (trusted / "jetson-07.scope").write_text("digits@*+jetson-07.*\n")
    with pytest.raises(KeyScopeError):  # a version name outside its scope
        stage_local(content, state_dir=installed, parent=parent, version="2",
                    key=device.signing, trusted=load_trusted_keys(trusted))
    assert ModelSlots(installed, "digits").standby() is None


def test_a_device_that_fine_tuned_still_takes_the_next_upstream_release(
    new_model: Any, installed: Path, publisher: Any, registry_server: Any, upstream_key: Any,
    make_keypair: Any, fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    """Upstream v1 -> two chained device fine-tunes (signed 2 and 3) -> upstream v2 (signed 2
    in the registry) is deployed -> a fine-tune of v2 -> a replay of v1 is refused. Names stay
    distinct and short for any chain; the manifest keeps the lineage."""
    from registry.errors import DowngradeError
    from registry.upload import default_version

    device_id = "jetson-07-with-a-rather-long-device-name"
    device = make_keypair(device_id)
    trusted = tmp_path / "trusted"
    shutil.copytree(upstream_key.trusted_dir, trusted)
    shutil.copy(device.public_path, trusted / device.public_path.name)
    (trusted / f"{device_id}.scope").write_text(f"digits@*+{device_id}.*\n")
    keys = load_trusted_keys(trusted)
    slots = ModelSlots(installed, "digits")

    def fine_tune(tag: str) -> str:
        parent = slots.active()
        assert parent is not None
        _, ckpt = tuned_checkpoint(new_model(), tmp_path / f"ft-{tag}")
        version = default_version(parent.manifest.base_release.version, device_id,
                                  max(parent.manifest.sequence, slots.highest_sequence()) + 1)
        staged = stage_local(read_checkpoint(ckpt), state_dir=installed, parent=parent,
                             version=version, key=device.signing, trusted=keys)
        slots.commit(staged.version)
        return staged.version

    first, second = fine_tune("a"), fine_tune("b")  # a fine-tune of a fine-tune
    assert first != second and all(v.startswith("1+jetson-07-") for v in (first, second))
    assert all(len(v) <= 64 and f"+{device_id}." in v for v in (first, second))
    m = slots.active().manifest  # type: ignore[union-attr]
    assert (m.sequence, m.parent, m.base_release.version, m.base_release.sequence) == (
        3, first, "1", 1)

    publisher.publish(new_model(), "2", parent="1")  # upstream's next release: sequence 2
    update(parse_ref("digits@2", registry_server.url), state_dir=installed, trusted=keys,
           cfg=fast_transfers)
    assert slots.active().version == "2"  # type: ignore[union-attr]

    third = fine_tune("c")
    assert third.startswith("2+") and slots.active().manifest.sequence == 4  # type: ignore[union-attr]
    with pytest.raises(DowngradeError, match="upstream release has sequence 1, below 2"):
        update(parse_ref("digits@1", registry_server.url), state_dir=installed, trusted=keys,
               cfg=fast_transfers)
    assert slots.active().version == third  # type: ignore[union-attr]
