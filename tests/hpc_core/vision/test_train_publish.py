"""A torchvision classifier trains with hpc-train on the digits, from pinned local weights;
its published manifest records the layout and the weights' sha256, and a device checks a
version's tensors against that layout torch-free."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from agent.storage.spec_check import check_model_spec
from hpc_core.cli import main
from hpc_core.model_spec import read_checkpoint, record_layout
from hpc_core.models import build_model
from registry.errors import SpecMismatchError
from registry.manifest import Manifest
from registry.publish import sign_version
from registry.signing import SigningKey


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tv")
    # "Pretrained" RGB weights of another class count: the head is left fresh, conv1 summed.
    src = build_model("torchvision/resnet18", num_classes=7, in_channels=3, image_size=32)
    weights = tmp / "resnet18.safetensors"
    save_file(src.state_dict(), str(weights))
    cfg = {
        "run": {"name": "tv", "output_dir": str(tmp / "run"), "seed": 0},
        "data": {"source": "digits", "image_size": 32, "val_fraction": 0.2},
        "model": {"name": "torchvision/resnet18", "weights": {
            "path": str(weights), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}},
        "optimizer": {"name": "adamw", "lr": 0.001},
        "training": {"global_batch_size": 16, "max_steps": 3, "precision": "fp32"},
        "logging": {"log_every_steps": 1},
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) == 0
    return tmp / "run"


def _sign(content: object) -> Manifest:
    key = SigningKey(name="upstream", key_id="0" * 16, private=Ed25519PrivateKey.generate())
    signed = sign_version(name="digits", version="1", sequence=1, model=content.model,  # type: ignore[attr-defined]
                          tensors=content.tensors, key=key, on_chunk=lambda ref, data: None,  # type: ignore[attr-defined]
                          training=content.training, spec_layout=content.layout)  # type: ignore[attr-defined]
    return Manifest.from_bytes(signed.manifest_bytes)


def test_trained_version_records_layout_and_pretrained(trained: Path) -> None:
    content = read_checkpoint(trained)
    assert content.model.name == "torchvision/resnet18" and content.model.weights is None
    assert (content.model.num_classes, content.model.in_channels) == (10, 1)
    assert content.training.pretrained is not None
    assert content.training.pretrained.file == "resnet18.safetensors"
    assert content.layout is not None
    assert content.layout.tensors["conv1.weight"] == ("F32", (64, 1, 7, 7))
    assert content.layout.tensors["fc.weight"] == ("F32", (10, 512))
    manifest = _sign(content)
    doc = json.loads(manifest.to_bytes())
    assert doc["training"]["pretrained"]["sha256"] == content.training.pretrained.sha256
    assert "weights" not in doc["model"]
    check_model_spec(manifest, manifest.to_bytes())  # torch-free, in process: passes


def test_tampered_layout_refused(trained: Path) -> None:
    content = read_checkpoint(trained)
    good = _sign(content)
    # Another model's weights under this spec: resnet34's tensors with its own layout, but
    # the manifest says resnet18.
    r34 = record_layout(content.model.model_copy(update={"name": "torchvision/resnet34"}))
    doc = json.loads(good.to_bytes())
    doc["layout"]["tensors"] = {k: [d, list(s)] for k, (d, s) in r34.tensors.items()}
    with pytest.raises(SpecMismatchError, match="does not match its model spec: missing tensor"):
        check_model_spec(Manifest.model_validate(doc), b"")
    # A layout built from another spec than the manifest's model.
    doc = json.loads(good.to_bytes())
    doc["layout"]["built_from"]["num_classes"] = 12
    with pytest.raises(SpecMismatchError, match="recorded layout was built from"):
        check_model_spec(Manifest.model_validate(doc), b"")
    doc = json.loads(good.to_bytes())
    del doc["layout"]
    with pytest.raises(SpecMismatchError, match="records no layout"):
        check_model_spec(Manifest.model_validate(doc), b"")


def test_a_recorded_layout_is_reused_only_for_its_own_spec(trained: Path) -> None:
    """A version staged from this checkpoint already holds its layout: reading the checkpoint
    with it builds no module (the device job's torch-free worker uploads this way), the
    tensors are still checked against it, and a layout recorded for another spec is ignored
    and built afresh."""
    built = read_checkpoint(trained).layout
    assert built is not None
    recorded = built.model_copy(update={"built_with": "the stage step's child"})
    assert read_checkpoint(trained, layout=recorded).layout == recorded
    wrong = recorded.model_copy(update={"tensors": {"fc.weight": ("F32", (10, 512))}})
    with pytest.raises(SpecMismatchError):
        read_checkpoint(trained, layout=wrong)
    other = recorded.model_copy(update={
        "built_from": recorded.built_from.model_copy(update={"num_classes": 12})})
    assert read_checkpoint(trained, layout=other).layout == built
