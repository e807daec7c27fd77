"""Manifest schema, chunk layout, safetensors parsing, pickle refusal and Ed25519 signatures."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from registry.chunks import ArtefactSource, lay_out
from registry.errors import (
    BadSignatureError,
    InvalidManifestError,
    KeyFileError,
    NotSafetensorsError,
    PickleRefusedError,
    UnknownKeyError,
    UnsafeNameError,
    UnsignedManifestError,
)
from registry.manifest import Manifest
from registry.safetensors_io import (
    FileRange,
    read_safetensors_index,
    refuse_pickled_file,
    safetensors_header,
)
from registry.signing import generate_keypair, load_signing_key, load_trusted_keys, verify_signature
from tests.support.manifests import CHUNK, PACK, manifest_for, model_state, parse

# ---------------------------------------------------------------------------------------------
# Layout


def test_layout_tiles_the_blob_with_tensor_aligned_chunks(tmp_path: Path) -> None:
    state = model_state()
    blobs: list[bytes] = []
    m, _ = manifest_for(tmp_path / "m.safetensors", state,
                        on_chunk=lambda ref, data: blobs.append(data))
    blob = b"".join(blobs)
    assert len(blob) == m.total_bytes == sum(v.numel() * 4 for v in state.values())
    for c, data in zip(m.chunks, blobs, strict=True):
        assert hashlib.sha256(data).hexdigest() == c.sha256 and len(data) == c.size <= CHUNK
    starts = set(m.chunk_offsets())
    for t in m.tensors:
        raw = state[t.name].numpy().tobytes()
        assert blob[t.offset : t.offset + t.nbytes] == raw
        assert hashlib.sha256(raw).hexdigest() == t.sha256
        if t.nbytes >= PACK:  # large tensors own their chunks
            end = t.offset + t.nbytes
            assert t.offset in starts and (end in starts or end == len(blob))
    small = [t for t in m.tensors if t.nbytes < PACK]
    assert [t.offset for t in small] == sorted(t.offset for t in small)
    assert small[0].offset == 0 and [t.name for t in small] == sorted(t.name for t in small)


def test_changing_one_tensor_changes_only_its_chunks(tmp_path: Path) -> None:
    state = model_state()
    m1, _ = manifest_for(tmp_path / "a.safetensors", state)
    again, _ = manifest_for(tmp_path / "b.safetensors", dict(state))
    assert again.chunks == m1.chunks  # deterministic

    changed = dict(state)
    changed["3.weight"] = state["3.weight"] + 1.0  # a 64x64 weight: 4 chunks of its own
    m2, _ = manifest_for(tmp_path / "c.safetensors", changed)
    new = {c.sha256 for c in m2.chunks} - {c.sha256 for c in m1.chunks}
    t = next(t for t in m2.tensors if t.name == "3.weight")
    own = {c.sha256 for c, off in zip(m2.chunks, m2.chunk_offsets(), strict=True)
           if t.offset <= off < t.offset + t.nbytes}
    assert new == own and len(own) == 4


def test_artefacts_follow_tensors_and_are_hashed(tmp_path: Path) -> None:
    art = tmp_path / "model.onnx"
    art.write_bytes(os.urandom(5000))
    m, _ = manifest_for(tmp_path / "m.safetensors", model_state(),
                        artefacts=[ArtefactSource("export/model.onnx", FileRange(art, 0, 5000))])
    (a,) = m.artefacts
    assert a.offset == m.tensor_bytes and a.nbytes == 5000
    assert a.sha256 == hashlib.sha256(art.read_bytes()).hexdigest()


def test_manifest_round_trips_through_its_bytes(tmp_path: Path) -> None:
    m, _ = manifest_for(tmp_path / "m.safetensors", model_state())
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert Manifest.from_bytes(m.to_bytes()).to_bytes() == m.to_bytes()


# ---------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("name", ["../../etc/x", "/etc/passwd", "a..b", "a/b", "a\\b", "",
                                  "__metadata__", ".hidden", "x.", "w\x00"])
def test_unsafe_tensor_names_are_refused(tmp_path: Path, name: str) -> None:
    _, doc = manifest_for(tmp_path / "m.safetensors", model_state())
    doc["tensors"][0]["name"] = name
    with pytest.raises(UnsafeNameError, match="tensor name"):
        parse(doc)


@pytest.mark.parametrize("path", ["../x", "/abs/x", "a/../b", ".hidden", "a\\b", "a//b", "./a"])
def test_unsafe_artefact_paths_are_refused(tmp_path: Path, path: str) -> None:
    art = tmp_path / "f.bin"
    art.write_bytes(b"x" * 10)
    _, doc = manifest_for(tmp_path / "m.safetensors", model_state(),
                          artefacts=[ArtefactSource("f.bin", FileRange(art, 0, 10))])
    doc["artefacts"][0]["path"] = path
    with pytest.raises(UnsafeNameError, match="artefact path"):
        parse(doc)


def test_layout_refuses_unsafe_names_before_reading(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"ok": torch.zeros(2)}, str(p))
    (src,) = read_safetensors_index(p)
    bad = type(src)(name="../../etc/x", dtype=src.dtype, shape=src.shape, data=src.data)
    with pytest.raises(UnsafeNameError):
        lay_out([bad])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["tensors"][1].update(offset=d["tensors"][1]["offset"] + 4), "tile"),
        (lambda d: d["tensors"][0].update(shape=[3, 3]), "needs"),
        (lambda d: d["chunks"].pop(), "cover"),
        (lambda d: d.update(unexpected=1), "unknown key"),
        (lambda d: d["chunks"][0].update(sha256="XYZ"), "hex"),
        (lambda d: d.update(chunk_size=16), "chunk_size"),
        (lambda d: d.update(version="1/../2"), "version"),
        (lambda d: d["tensors"][0].update(dtype="PICKLE"), "dtype"),
        (lambda d: d.pop("sequence"), "sequence"),
        (lambda d: d.update(sequence=0), "sequence"),
        (lambda d: d["model"].update(num_classes=None), "num_classes must be set"),
    ],
)
def test_inconsistent_manifests_are_refused(tmp_path: Path, edit: Any, message: str) -> None:
    _, doc = manifest_for(tmp_path / "m.safetensors", model_state())
    edit(doc)
    with pytest.raises(InvalidManifestError, match=message):
        parse(doc)


def test_non_json_and_oversized_manifests_are_refused() -> None:
    with pytest.raises(InvalidManifestError, match="JSON"):
        Manifest.from_bytes(b"\x80\x04not json")
    with pytest.raises(InvalidManifestError, match="limit"):
        Manifest.from_bytes(b" " * (65 << 20))


# ---------------------------------------------------------------------------------------------
# safetensors and pickles


def test_safetensors_index_points_at_the_exact_bytes(tmp_path: Path) -> None:
    state = model_state()
    p = tmp_path / "m.safetensors"
    save_file(state, str(p))
    raw = p.read_bytes()
    for t in read_safetensors_index(p):
        assert raw[t.data.start : t.data.start + t.data.nbytes] == state[t.name].numpy().tobytes()
        assert tuple(state[t.name].shape) == t.shape


def test_header_written_by_hand_loads_with_safetensors(tmp_path: Path) -> None:
    state = model_state()
    m, _ = manifest_for(tmp_path / "m.safetensors", state)
    out = tmp_path / "rebuilt.safetensors"
    with open(out, "wb") as f:
        f.write(safetensors_header(m.tensors, {"edgetrain.ref": m.ref}))
        for t in m.tensors:
            f.write(state[t.name].numpy().tobytes())
    loaded = load_file(str(out))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_pickle_posing_as_safetensors_is_refused(tmp_path: Path) -> None:
    torch_zip, raw_pickle = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    torch.save(model_state(), torch_zip)
    raw_pickle.write_bytes(pickle.dumps({"w": [1, 2, 3]}, protocol=4))
    for p in (torch_zip, raw_pickle):
        with pytest.raises(PickleRefusedError, match="pickle"):
            read_safetensors_index(p)


def test_malformed_safetensors_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file(model_state(), str(p))
    raw = p.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[:-100])
    (tmp_path / "garbage.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(NotSafetensorsError, match="truncated"):
        read_safetensors_index(tmp_path / "trunc.safetensors")
    with pytest.raises(NotSafetensorsError):
        read_safetensors_index(tmp_path / "garbage.safetensors")


def test_pickled_artefacts_are_refused_plain_files_pass(tmp_path: Path) -> None:
    (tmp_path / "w.pt").write_bytes(b"anything")
    (tmp_path / "w.bin").write_bytes(pickle.dumps([1, 2], protocol=2))
    torch.save({"a": torch.zeros(1)}, tmp_path / "engine.onnx")
    for name in ("w.pt", "w.bin", "engine.onnx"):
        with pytest.raises(PickleRefusedError):
            refuse_pickled_file(tmp_path / name, name)
    with zipfile.ZipFile(tmp_path / "bundle.zip", "w") as z:
        z.writestr("engine.plan", b"\x00" * 10)
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07\x12\x04onnx")
    refuse_pickled_file(tmp_path / "bundle.zip", "bundle")
    refuse_pickled_file(tmp_path / "model.onnx", "model")


# ---------------------------------------------------------------------------------------------
# Signing


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    priv, pub = generate_keypair(tmp_path / "keys", "upstream")
    other_priv, _ = generate_keypair(tmp_path / "other", "intruder")
    return {"key": load_signing_key(priv), "trusted": load_trusted_keys(pub.parent),
            "other": load_signing_key(other_priv), "priv": priv, "pub": pub}


def test_keygen_writes_private_0600_and_never_overwrites(keys: dict, tmp_path: Path) -> None:
    assert stat.S_IMODE(keys["priv"].stat().st_mode) == 0o600
    assert keys["key"].name == "upstream" and len(keys["key"].key_id) == 16
    with pytest.raises(KeyFileError, match="never overwritten"):
        generate_keypair(tmp_path / "keys", "upstream")


def test_signature_verifies_and_names_the_signer(keys: dict) -> None:
    body = b'{"manifest": 1}\n'
    signer = verify_signature(body, keys["key"].sign_manifest(body), keys["trusted"])
    assert signer.key_id == keys["key"].key_id and signer.name == "upstream"


def test_unknown_key_tampering_and_missing_signature_each_have_their_error(keys: dict) -> None:
    body = b'{"manifest": 1}\n'
    with pytest.raises(UnknownKeyError, match="not trusted"):
        verify_signature(body, keys["other"].sign_manifest(body), keys["trusted"])
    with pytest.raises(BadSignatureError, match="altered"):
        verify_signature(body.replace(b"1", b"2"), keys["key"].sign_manifest(body), keys["trusted"])
    with pytest.raises(UnsignedManifestError, match=r"no manifest\.sig"):
        verify_signature(body, None, keys["trusted"])
    with pytest.raises(UnsignedManifestError, match="not an"):
        verify_signature(body, b"garbage", keys["trusted"])


def test_signature_is_domain_separated(keys: dict) -> None:
    """A bare Ed25519 signature over the manifest bytes (made for another purpose) fails."""
    import base64

    body = b'{"manifest": 1}\n'
    doc = json.loads(keys["key"].sign_manifest(body))
    doc["signature"] = base64.b64encode(keys["key"].private.sign(body)).decode()
    with pytest.raises(BadSignatureError):
        verify_signature(body, json.dumps(doc).encode(), keys["trusted"])


def test_key_files_are_checked(keys: dict, tmp_path: Path) -> None:
    os.chmod(keys["priv"], 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_signing_key(keys["priv"])
    with pytest.raises(KeyFileError, match="private key"):
        load_trusted_keys(keys["priv"])
    bad = tmp_path / "bad-trust"
    bad.mkdir()
    (bad / "oops.pub.pem").write_bytes(keys["priv"].read_bytes())
    with pytest.raises(KeyFileError, match="private key"):
        load_trusted_keys(bad)
    with pytest.raises(KeyFileError, match="do not exist"):
        load_trusted_keys(tmp_path / "nowhere")
