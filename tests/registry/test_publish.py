"""Publishing checkpoints into a registry folder or S3: layout, dedup, refusals, CLI."""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_core.checkpoint import save_checkpoint
from hpc_core.config import config_from_dict
from hpc_core.model_spec import read_checkpoint
from hpc_core.models import build_model
from hpc_core.publish_cli import register_cli
from registry.errors import (
    PickleRefusedError,
    PublishError,
    RefError,
    StoreConflictError,
    StoreError,
    VersionExistsError,
)
from registry.manifest import Manifest
from registry.names import chunk_key
from registry.publish import publish_content, publish_version
from registry.signing import generate_keypair, load_signing_key, load_trusted_keys, verify_signature
from registry.stores import HttpStore, LocalStore, open_store

MODEL = {"name": "small_cnn", "kwargs": {"width": 8, "norm": "batch"}, "num_classes": 10,
         "in_channels": 1, "image_size": 8}
CHUNK, PACK = 4096, 1024


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = build_model(MODEL["name"], num_classes=10, in_channels=1, image_size=8, **MODEL["kwargs"])
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def checkpoint(dest: Path, weights: dict[str, torch.Tensor], step: int = 5) -> Path:
    cfg = config_from_dict({"model": MODEL, "training": {"max_steps": step}})
    return save_checkpoint(dest, model_state=weights, trainer_state={
        "step": step, "epoch": 1, "config": cfg.to_dict(), "metrics": {"eval/acc": 0.91,
                                                                      "eval/loss": 0.3}})


@pytest.fixture
def key(tmp_path: Path) -> Any:
    priv, _ = generate_keypair(tmp_path / "keys", "upstream")
    return load_signing_key(priv)


def publish(src: Path, reg: Path, version: str, key: Any, **kw: Any) -> Any:
    return publish_content(read_checkpoint(src), LocalStore(reg), name="digits", version=version,
                           key=key, chunk_size=CHUNK, pack_below=PACK, **kw)


def chunk_files(reg: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime_ns for p in (reg / "chunks").rglob("*") if p.is_file()}


def test_publish_writes_signed_manifest_and_content_addressed_chunks(
    tmp_path: Path, key: Any
) -> None:
    weights = state(0)
    src = checkpoint(tmp_path / "ckpt", weights)
    reg = tmp_path / "reg"
    report = publish(src, reg, "1", key)

    body = (reg / "digits/1/manifest.json").read_bytes()
    signer = verify_signature(body, (reg / "digits/1/manifest.sig").read_bytes(),
                             load_trusted_keys(tmp_path / "keys"))
    m = Manifest.from_bytes(body)
    assert signer.key_id == m.signer.key_id and m == report.manifest
    assert m.model.name == "small_cnn" and m.model.kwargs == MODEL["kwargs"]
    assert m.training.step == 5 and m.training.metrics == {"eval/acc": 0.91, "eval/loss": 0.3}
    cfg = config_from_dict({"model": MODEL, "training": {"max_steps": 5}})
    assert m.training.config_sha256 == cfg.digest()
    assert report.chunks_written == len({c.sha256 for c in m.chunks}) and report.chunks_reused == 0

    blob = b""
    for c in m.chunks:  # every chunk is stored under its own hash
        data = (reg / chunk_key(c.sha256)).read_bytes()
        assert hashlib.sha256(data).hexdigest() == c.sha256
        blob += data
    for t in m.tensors:  # and the blob holds every tensor's exact bytes
        assert blob[t.offset : t.offset + t.nbytes] == weights[t.name].numpy().tobytes()
    assert not [p for p in reg.rglob(".tmp-*")]


def test_republishing_unchanged_tensors_writes_no_chunk(tmp_path: Path, key: Any) -> None:
    weights = state(0)
    reg = tmp_path / "reg"
    publish(checkpoint(tmp_path / "c1", weights), reg, "1", key)
    before = chunk_files(reg)

    again = publish(checkpoint(tmp_path / "c2", dict(weights), step=9), reg, "2", key, parent="1")
    assert again.chunks_written == 0 and again.bytes_written == 0
    assert chunk_files(reg) == before  # not one chunk file created or rewritten
    assert again.manifest.parent == "1" and again.manifest.training.step == 9

    changed = dict(weights)
    changed["head.2.weight"] = weights["head.2.weight"] * 2  # 10x32 floats: 1280 B, own chunk
    third = publish(checkpoint(tmp_path / "c3", changed), reg, "3", key, parent="2")
    assert third.chunks_written == 1 and third.bytes_written == 1280
    assert len(chunk_files(reg)) == len(before) + 1


def test_publish_resolves_a_run_dir_to_its_final_checkpoint(tmp_path: Path, key: Any) -> None:
    run = tmp_path / "run"
    checkpoint(run / "checkpoints" / "step_00000002", state(1), step=2)
    checkpoint(run / "checkpoints" / "final", state(2), step=7)
    report = publish(run, tmp_path / "reg", "1", key)
    assert report.manifest.training.step == 7


def test_versions_are_immutable_and_parents_must_exist(tmp_path: Path, key: Any) -> None:
    src = checkpoint(tmp_path / "c", state(0))
    reg = tmp_path / "reg"
    publish(src, reg, "1", key)
    with pytest.raises(VersionExistsError, match="immutable"):
        publish(src, reg, "1", key)
    with pytest.raises(PublishError, match=r"parent digits@7"):
        publish(src, reg, "2", key, parent="7")
    with pytest.raises(PublishError, match="version"):
        publish(src, reg, "../2", key)
    with pytest.raises(PublishError, match="no complete checkpoint"):
        publish(tmp_path / "nothing", reg, "3", key)


def test_sequence_increases_per_model_and_stays_above_the_parent(tmp_path: Path, key: Any) -> None:
    src, reg = checkpoint(tmp_path / "c", state(0)), tmp_path / "reg"
    # Version strings are labels: "10" after "9" and "1.0" after "10" still count up.
    seqs = [publish(src, reg, v, key).manifest.sequence for v in ("9", "10", "1.0")]
    assert seqs == [1, 2, 3]
    assert publish(src, reg, "x", key, parent="9").manifest.sequence == 4
    # An upload registry that never saw the counter still stays above the parent's sequence.
    content = read_checkpoint(src)
    child = publish_version(LocalStore(tmp_path / "uploads"), name="digits", version="x+dev",
                            model=content.model, tensors=content.tensors, key=key, parent="x",
                            parent_seq=4, chunk_size=CHUNK, pack_below=PACK)
    assert child.manifest.sequence == 5
    (reg / "digits" / "_sequence.json").write_text("[" * 1000)
    with pytest.raises(PublishError, match="unreadable"):
        publish(src, reg, "y", key)


def test_pickle_posing_as_a_checkpoint_is_refused(tmp_path: Path, key: Any) -> None:
    src = checkpoint(tmp_path / "c", state(0))
    torch.save(state(0), src / "model.safetensors")  # complete marker and all: only the file lies
    reg = tmp_path / "reg"
    with pytest.raises(PickleRefusedError, match="pickle"):
        publish(src, reg, "1", key)
    assert not reg.exists() or not any(reg.rglob("*.json"))


def test_pickled_artefacts_are_refused(tmp_path: Path, key: Any) -> None:
    src = checkpoint(tmp_path / "c", state(0))
    weights = tmp_path / "extra.pt"
    torch.save(state(0), weights)
    with pytest.raises(PickleRefusedError):
        publish(src, tmp_path / "reg", "1", key, artefacts=[weights])


def test_artefact_folders_keep_their_names(tmp_path: Path, key: Any) -> None:
    exports = tmp_path / "exports"
    (exports / "int8").mkdir(parents=True)
    (exports / "int8" / "model.onnx").write_bytes(b"onnx" * 300)
    (exports / "report.json").write_text('{"acc": 0.9}')
    m = publish(checkpoint(tmp_path / "c", state(0)), tmp_path / "reg", "1", key,
                artefacts=[exports]).manifest
    assert [a.path for a in m.artefacts] == ["exports/int8/model.onnx", "exports/report.json"]


def test_s3_target_without_boto3_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    with pytest.raises(StoreError, match=r"pip install 'edgetrain\[s3\]'"):
        open_store("s3://bucket/registry")
    assert isinstance(open_store("https://example.com/registry"), HttpStore)  # one factory
    with pytest.raises(RefError, match="unsupported registry scheme"):
        open_store("ftp://example.com/registry")


def test_s3_target_dedups_like_a_folder(
    tmp_path: Path, key: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    moto = pytest.importorskip("moto", reason="S3 round trip needs moto (pip install moto boto3)")
    import boto3

    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="models")
        store = open_store("s3://models/edgetrain")
        weights = state(0)
        first = publish_content(read_checkpoint(checkpoint(tmp_path / "c1", weights)), store,
                                name="digits", version="1", key=key, chunk_size=CHUNK,
                                pack_below=PACK)
        second = publish_content(read_checkpoint(checkpoint(tmp_path / "c2", dict(weights))),
                                 store, name="digits", version="2", key=key, parent="1",
                                 chunk_size=CHUNK, pack_below=PACK)
        keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="models")["Contents"]]
        assert first.chunks_written > 0 and second.chunks_written == 0
        assert sum(k.startswith("edgetrain/chunks/sha256/") for k in keys) == first.chunks_written
        stored = store.get("digits/2/manifest.json", 1 << 20)
        assert stored is not None and Manifest.from_bytes(stored).parent == "1"
        # Conditional writes (If-None-Match: *): a manifest is never replaced; a chunk that is
        # there already is simply there.
        with pytest.raises(StoreConflictError, match="never overwritten"):
            store.put("digits/2/manifest.json", b"{}")
        assert store.get("digits/2/manifest.json", 1 << 20) == stored
        chunk = chunk_key(Manifest.from_bytes(stored).chunks[0].sha256)
        before = store.get(chunk, 1 << 20)
        store.put(chunk, b"other bytes")
        assert store.get(chunk, 1 << 20) == before


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hpc-train")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_keygen_and_publish_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["keygen", "--out", str(tmp_path / "k"), "--name", "ci"]) == 0
    assert "never copy it to devices" in capsys.readouterr().out  # an upstream key
    assert cli(["keygen", "--out", str(tmp_path / "k"), "--name", "ci"]) == 2  # never overwrite
    src = checkpoint(tmp_path / "c", state(0))
    argv = ["publish", str(src), "--registry", str(tmp_path / "reg"), "--name", "digits",
            "--version", "1", "--sign-key", str(tmp_path / "k" / "ci.key.pem")]
    assert cli(argv) == 0
    assert "published digits@1" in capsys.readouterr().out
    assert cli(argv) == 2  # version exists
    assert "immutable" in capsys.readouterr().err


def test_keygen_scope_writes_what_the_device_key_may_sign(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "k"
    assert cli(["keygen", "--out", str(keys), "--name", "jetson-07",
                "--scope", "digits@*+jetson-07.*", "--scope", "probe"]) == 0
    out = capsys.readouterr().out
    assert "jetson-07.scope" in out and "never copy it to devices" in out  # not only its own
    assert cli(["keygen", "--out", str(tmp_path / "d"), "--name", "jetson-08",
                "--scope", "digits@*+jetson-08.*"]) == 0
    out = capsys.readouterr().out  # the device's own key: it lives on that device
    assert "never copy it to devices" not in out and "keep it on that device" in out
    (key,) = load_trusted_keys(keys).values()
    assert key.scope == ("digits@*+jetson-07.*", "probe")
    assert key.may_sign("digits", "3+jetson-07.1") and key.may_sign("probe", "9")
    assert not key.may_sign("digits", "4") and not key.may_sign("digits", "3+jetson-08.1")
    # Never overwritten; a pattern that would not read back as itself writes nothing at all.
    assert cli(["keygen", "--out", str(keys), "--name", "jetson-07", "--scope", "digits"]) == 2
    assert load_trusted_keys(keys)[key.key_id].scope == key.scope
    for bad in ("digits # all", "", "a b"):
        assert cli(["keygen", "--out", str(keys), "--name", "x", "--scope", bad]) == 2
        assert "scope pattern" in capsys.readouterr().err
    assert sorted(p.name for p in keys.iterdir()) == [
        "jetson-07.key.pem", "jetson-07.pub.pem", "jetson-07.scope"
    ]
