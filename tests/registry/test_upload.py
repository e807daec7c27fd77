"""Upload back: a real on-device fine-tune published as a device-signed child version."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.cli import main as agentctl
from agent.finetune.active import load_active
from agent.storage.update import update
from registry.errors import (
    FetchFailedError,
    NoActiveModelError,
    PickleRefusedError,
    UnknownKeyError,
)
from registry.manifest import Manifest
from registry.refs import parse_ref
from registry.signing import load_trusted_keys, verify_signature
from registry.transfer import TransferConfig
from registry.upload import upload


def device_upload(checkpoint: Path, state_dir: Path, **kw: Any) -> Any:
    """What ``agentctl upload`` does: the installed parent, the checkpoint's content."""
    from agent.storage.slots import ModelSlots
    from hpc_core.model_spec import read_checkpoint

    parent = ModelSlots(state_dir, "digits").installed()
    return upload(read_checkpoint(checkpoint), parent=parent.manifest, **kw)


@dataclass(frozen=True)
class FineTune:
    base: torch.nn.Module
    tuned: torch.nn.Module
    checkpoint: Path
    head: tuple[str, ...]
    """The tensors the fine-tune trained (all others were frozen)."""


@pytest.fixture(scope="module")
def finetune(new_model: Any, tmp_path_factory: pytest.TempPathFactory) -> FineTune:
    """A few real optimizer steps on sklearn's digits with everything but the head frozen,
    through hpc_core's Trainer, as the device's fine-tune job runs it."""
    from hpc_core.config import config_from_dict
    from hpc_core.trainer import Trainer

    base = new_model()
    model = copy.deepcopy(base)
    head = ("17.weight", "17.bias")
    for name, p in model.named_parameters():
        p.requires_grad = name in head
    out = tmp_path_factory.mktemp("finetune")
    cfg = config_from_dict({
        "run": {"name": "finetune", "output_dir": str(out), "seed": 0},
        "data": {"source": "digits"},
        "model": {"name": "mlp", "kwargs": {"hidden": [128] * 8}},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "training": {"global_batch_size": 64, "max_steps": 3, "device": "cpu"},
        "checkpoint": {"best_metric": None},
        "logging": {"progress": "off"},
    })
    result = Trainer(cfg, model=model).train()
    assert result.checkpoint_dir is not None
    return FineTune(base, model.eval(), result.checkpoint_dir, head)


@pytest.fixture
def device(make_keypair: Any, upstream_key: Any, tmp_path: Path) -> Any:
    """The device's own key; plus a cloud-side trusted folder holding upstream's and its key."""
    key = make_keypair("jetson-07")
    both = tmp_path / "cloud-trusted"
    both.mkdir()
    for pub in (key.public_path, upstream_key.public_path):
        shutil.copy(pub, both / pub.name)
    return key, both


@pytest.fixture
def pulled(finetune: FineTune, publisher: Any, registry_server: Any, upstream_key: Any,
           fast_transfers: TransferConfig, tmp_path: Path) -> Path:
    """A device state with version 1 (the fine-tune's starting point) installed."""
    publisher.publish(finetune.base, "1")
    state = tmp_path / "state"
    update(parse_ref("digits@1", registry_server.url), state_dir=state,
           trusted=load_trusted_keys(upstream_key.trusted_dir), cfg=fast_transfers)
    registry_server.reset()
    return state


def exports(tmp_path: Path) -> Path:
    folder = tmp_path / "exports"
    folder.mkdir(exist_ok=True)
    # Opaque to the upload: stands in for the INT8 ONNX file and the gate report.
    (folder / "model.int8.onnx").write_bytes(torch.randn(3000).numpy().tobytes())
    (folder / "gates.json").write_text(json.dumps({"accuracy": 0.93, "latency_ms": 1.7}))
    return folder


def new_chunk_bytes(child: Manifest, parent: Manifest) -> int:
    known = {c.sha256 for c in parent.chunks}
    fresh = {c.sha256: c.size for c in child.chunks if c.sha256 not in known}
    return sum(fresh.values())


def test_upload_sends_only_changed_tensors_and_is_device_signed(
    finetune: FineTune, pulled: Path, registry_server: Any, upstream_key: Any, device: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    key, cloud_trusted = device
    report = device_upload(finetune.checkpoint, pulled,
                    target=registry_server.url, key=key.signing, artefacts=[exports(tmp_path)],
                    metrics={"device/latency_ms": 1.7}, cfg=fast_transfers)
    child = report.manifest
    parent = Manifest.from_bytes((registry_server.root / "digits/1/manifest.json").read_bytes())
    assert child.parent == "1" and child.version.startswith("1+jetson-07.")
    assert child.signer.name == "jetson-07" and child.signer.key_id == key.signing.key_id
    assert child.training.metrics["device/latency_ms"] == 1.7

    before = {t.name: t.sha256 for t in parent.tensors}
    changed = {t.name for t in child.tensors if before[t.name] != t.sha256}
    assert changed == set(finetune.head)  # frozen tensors are byte-identical
    # What went over the wire: the head's chunks (its weight, the packed biases), the two
    # artefacts, the manifest and its signature. Nothing the registry already had.
    puts = [r for r in registry_server.requests if r.method == "PUT"]
    body = (registry_server.root / f"digits/{child.version}/manifest.json").read_bytes()
    sig = (registry_server.root / f"digits/{child.version}/manifest.sig").read_bytes()
    seq = (registry_server.root / "digits/_sequence.json").read_bytes()
    assert child.sequence == parent.sequence + 1 == 2
    assert report.bytes_written == new_chunk_bytes(child, parent)
    assert registry_server.stats()["bytes_received"] == (
        report.bytes_written + len(body) + len(sig) + len(seq)
    )
    assert len(puts) == report.chunks_written + 3 == 4 + 3
    assert not {c.sha256 for c in parent.chunks} & {r.path.rsplit("/", 1)[-1] for r in puts}

    # The cloud knows which device produced it: its key verifies, upstream's alone does not.
    assert verify_signature(body, sig, load_trusted_keys(cloud_trusted)).name == "jetson-07"
    with pytest.raises(UnknownKeyError):
        verify_signature(body, sig, load_trusted_keys(upstream_key.trusted_dir))

    # Another device that trusts this one pulls the fine-tuned version and gets its weights.
    other = tmp_path / "other-device"
    update(parse_ref(f"digits@{child.version}", registry_server.url), state_dir=other,
           trusted=load_trusted_keys(cloud_trusted), cfg=fast_transfers)
    loaded = load_active(other, "digits", trusted=load_trusted_keys(cloud_trusted), verify=True)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded.module(x), finetune.tuned(x))
    assert (loaded.slot / "artefacts/exports/gates.json").read_text().startswith('{"accuracy"')


def test_interrupted_upload_resumes_with_what_is_missing(
    finetune: FineTune, pulled: Path, registry_server: Any, device: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    key, _ = device
    cfg = fast_transfers.model_copy(update={"retries": 1})
    registry_server.allow_puts(2)  # the link dies after two chunks
    with pytest.raises(FetchFailedError, match="PUT chunks/"):
        device_upload(finetune.checkpoint, pulled, target=registry_server.url,
               key=key.signing, version="1.ft", artefacts=[exports(tmp_path)], cfg=cfg)
    assert not (registry_server.root / "digits/1.ft/manifest.json").exists()  # not half published
    first = registry_server.stats()["bytes_received"]
    assert first > 0

    registry_server.reset()
    report = device_upload(finetune.checkpoint, pulled,
                    target=registry_server.url, key=key.signing, version="1.ft",
                    artefacts=[exports(tmp_path)], cfg=cfg)
    body = (registry_server.root / "digits/1.ft/manifest.json").read_bytes()
    sig = (registry_server.root / "digits/1.ft/manifest.sig").read_bytes()
    parent = Manifest.from_bytes((registry_server.root / "digits/1/manifest.json").read_bytes())
    total = new_chunk_bytes(report.manifest, parent)
    seq = (registry_server.root / "digits/_sequence.json").read_bytes()
    # The resumed run sent exactly what the first one had not.
    assert report.bytes_written == total - first
    assert registry_server.stats()["bytes_received"] == (
        total - first + len(body) + len(sig) + len(seq)
    )


def test_upload_refusals(finetune: FineTune, pulled: Path, registry_server: Any, device: Any,
                         fast_transfers: TransferConfig, tmp_path: Path) -> None:
    key, _ = device
    pickled = tmp_path / "weights.bin"
    torch.save(finetune.tuned.state_dict(), pickled)
    with pytest.raises(PickleRefusedError):
        device_upload(finetune.checkpoint, pulled, target=registry_server.url,
               key=key.signing, artefacts=[pickled], cfg=fast_transfers)
    assert not [r for r in registry_server.requests if r.method == "PUT"]
    with pytest.raises(NoActiveModelError, match="pull one first"):
        device_upload(finetune.checkpoint, tmp_path / "empty",
               target=registry_server.url, key=key.signing, cfg=fast_transfers)


def test_agentctl_upload_to_a_registry_folder(
    finetune: FineTune, pulled: Path, device: Any, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key, cloud_trusted = device
    target = tmp_path / "cloud-registry"
    code = agentctl(["upload", str(finetune.checkpoint.parent.parent), "--registry", str(target),
                     "--state-dir", str(pulled), "--sign-key", str(key.private_path),
                     "--version", "1.1", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert "published digits@1.1" in capsys.readouterr().out
    body = (target / "digits/1.1/manifest.json").read_bytes()
    verify_signature(body, (target / "digits/1.1/manifest.sig").read_bytes(),
                    load_trusted_keys(cloud_trusted))
    # A folder registry that lacked the parent's chunks receives the whole model.
    assert Manifest.from_bytes(body).parent == "1"
    assert agentctl(["upload", str(finetune.checkpoint), "--registry", str(target),
                     "--state-dir", str(pulled), "--sign-key", str(key.private_path),
                     "--version", "1.1"]) == 2  # versions are immutable
