"""Pulling over a real loopback HTTP server: verification first, delta, resume, refusals."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.finetune.active import load_active
from agent.storage.chunk_store import ChunkStore
from agent.storage.slots import ModelSlots
from agent.storage.update import pull, update
from registry.errors import (
    BadSignatureError,
    ChunkHashError,
    FetchFailedError,
    InsufficientDiskError,
    ManifestMismatchError,
    PickleRefusedError,
    RefError,
    SpecMismatchError,
    TensorHashError,
    TruncatedError,
    UnknownKeyError,
    UnsafeNameError,
    UnsignedManifestError,
)
from registry.manifest import Manifest
from registry.names import chunk_key
from registry.refs import parse_ref
from registry.signing import SigningKey, load_trusted_keys
from registry.transfer import TransferConfig


def trusted(key: Any) -> dict:
    return load_trusted_keys(key.trusted_dir)


def get(server: Any, state: Path, version: str, cfg: TransferConfig,
        key: Any, **kw: Any) -> Any:
    return update(parse_ref(f"digits@{version}", server.url), state_dir=state, trusted=trusted(key),
                  cfg=cfg, **kw)


def assert_active(state: Path, version: str, model: torch.nn.Module, key: Any) -> None:
    """The active slot verifies end to end and computes exactly what ``model`` computes."""
    loaded = load_active(state, "digits", trusted=trusted(key), verify=True)
    assert loaded.manifest.version == version
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded.module(x), model.eval()(x))


def chunk_bytes(server: Any) -> int:
    return sum(r.body_bytes for r in server.chunk_requests())


def manifest_of(root: Path, version: str) -> Manifest:
    return Manifest.from_bytes((root / f"digits/{version}/manifest.json").read_bytes())


def perturbed(model: torch.nn.Module, names: list[str], seed: int = 1) -> torch.nn.Module:
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name in names:
                p.add_(torch.randn(p.shape, generator=g))
    return new


# ---------------------------------------------------------------------------------------------
# Happy path, delta


def test_pull_installs_a_verified_model_and_moves_each_byte_once(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    man = publisher.publish(model, "1").manifest
    seen: list[tuple[int, int]] = []
    result = get(registry_server, tmp_path / "state", "1", fast_transfers, upstream_key,
                 progress=lambda d, t: seen.append((d, t)))
    assert result.switch.changed and result.switch.active.slot == "a"
    assert result.pulled.key.name == "upstream"
    assert_active(tmp_path / "state", "1", model, upstream_key)
    assert chunk_bytes(registry_server) == man.total_bytes == result.pulled.bytes_fetched
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1] == (man.total_bytes, man.total_bytes)

    again = get(registry_server, tmp_path / "state", "1", fast_transfers, upstream_key)
    assert not again.switch.changed and again.pulled.chunks_fetched == 0
    assert chunk_bytes(registry_server) == man.total_bytes  # nothing fetched the second time


def test_delta_pull_moves_only_the_changed_chunks(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    v1 = new_model()
    m1 = publisher.publish(v1, "1").manifest
    get(registry_server, tmp_path / "state", "1", fast_transfers, upstream_key)

    # 2 of 18 tensors (11%): a 64 KiB hidden weight and a bias that shares the packed chunk.
    v2 = perturbed(v1, ["5.weight", "9.bias"])
    m2 = publisher.publish(v2, "2", parent="1").manifest
    registry_server.reset()
    result = get(registry_server, tmp_path / "state", "2", fast_transfers, upstream_key)

    new_chunks = {c.sha256: c.size for c in m2.chunks} .keys() - {c.sha256 for c in m1.chunks}
    expected = sum(c.size for c in m2.chunks if c.sha256 in new_chunks)
    weight = next(t for t in m2.tensors if t.name == "5.weight")
    pack = next(c for c in m2.chunks if c.sha256 in new_chunks and c.size < publisher.chunk_size)
    assert expected == weight.nbytes + pack.size  # 4 chunks of the weight + the small-tensor pack
    assert chunk_bytes(registry_server) == expected == result.pulled.bytes_fetched
    manifest_and_sig = sum(r.body_bytes for r in registry_server.requests
                           if "/chunks/" not in r.path)
    assert registry_server.stats()["bytes_served"] == expected + manifest_and_sig
    assert_active(tmp_path / "state", "2", v2, upstream_key)
    assert result.switch.previous is not None and result.switch.previous.version == "1"


def test_file_registry_and_url_refs(new_model: Any, publisher: Any, upstream_key: Any,
                                    fast_transfers: TransferConfig, tmp_path: Path) -> None:
    model = new_model()
    publisher.publish(model, "1")
    ref = parse_ref(publisher.root.as_uri() + "/digits/1/manifest.json")
    assert (ref.name, ref.version) == ("digits", "1")
    update(ref, state_dir=tmp_path / "state", trusted=trusted(upstream_key), cfg=fast_transfers)
    assert_active(tmp_path / "state", "1", model, upstream_key)


def test_redirected_registry_is_followed(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    publisher.publish(model, "1")
    registry_server.moved_prefix = "/old-location"
    update(parse_ref("digits@1", registry_server.url + "/old-location"),
           state_dir=tmp_path / "state", trusted=trusted(upstream_key), cfg=fast_transfers)
    assert_active(tmp_path / "state", "1", model, upstream_key)
    assert {r.status for r in registry_server.requests} == {301, 206, 200}


def test_parse_ref_forms_and_errors() -> None:
    r = parse_ref("https://cdn.example.com/reg/digits-cnn/2025.1/")
    assert (r.registry, r.name, r.version) == (
        "https://cdn.example.com/reg", "digits-cnn", "2025.1"
    )
    assert parse_ref("digits@3", "http://h:8/r/").registry == "http://h:8/r"
    assert parse_ref("s3://bucket/p/digits/3").registry == "s3://bucket/p"
    for bad, msg in [("digits", "give a version"), ("digits@3", "needs a registry"),
                     ("ftp://h/r/digits/3", "unsupported scheme"), ("Bad Name@1", "model name")]:
        with pytest.raises(RefError, match=msg):
            parse_ref(bad, "http://h/r" if bad.startswith("Bad") else None)


# ---------------------------------------------------------------------------------------------
# Cuts, resume, retries, timeouts, bandwidth


def test_cut_at_20_random_offsets_every_pull_completes_and_verifies(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    man = publisher.publish(model, "1").manifest
    get(registry_server, tmp_path / "probe", "1", fast_transfers, upstream_key)
    full = registry_server.stats()["bytes_served"]
    rng = random.Random(1234)
    for trial, offset in enumerate(sorted(rng.randrange(full) for _ in range(20))):
        registry_server.reset()
        registry_server.cut_at([offset])
        state = tmp_path / f"state{trial}"
        get(registry_server, state, "1", fast_transfers, upstream_key)
        assert_active(state, "1", model, upstream_key)
        assert registry_server.faults.cuts == [], f"cut at {offset} never happened"
        # Resumed with Range from the exact byte: no chunk byte crossed the wire twice.
        assert chunk_bytes(registry_server) == man.total_bytes, f"cut at {offset}"
        assert any(r.range not in (None, "bytes=0-") for r in registry_server.requests) or (
            offset < full - man.total_bytes  # the cut hit the manifest or signature instead
        )


def test_twenty_hard_resets_in_one_pull(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    man = publisher.publish(model, "1").manifest
    rng = random.Random(99)
    registry_server.cut_at(sorted(rng.randrange(man.total_bytes) for _ in range(20)), mode="rst")
    cfg = fast_transfers.model_copy(update={"retries": 20})
    get(registry_server, tmp_path / "state", "1", cfg, upstream_key)
    assert_active(tmp_path / "state", "1", model, upstream_key)
    assert registry_server.faults.cuts == []


def test_partial_chunk_left_by_a_previous_run_resumes_with_range(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    man = publisher.publish(model, "1").manifest
    state = tmp_path / "state"
    big, corrupt = man.chunks[1], man.chunks[2]
    store = ChunkStore(state)
    store.partial_dir.mkdir(parents=True)
    half = (publisher.root / chunk_key(big.sha256)).read_bytes()[: big.size // 2]
    store.partial(big.sha256).write_bytes(half)
    store.partial(corrupt.sha256).write_bytes(b"\xff" * 100)  # torn write after a power cut
    get(registry_server, state, "1", fast_transfers, upstream_key)
    assert_active(state, "1", model, upstream_key)
    ranges = [r.range for r in registry_server.chunk_requests() if big.sha256 in r.path]
    assert ranges == [f"bytes={len(half)}-"]
    # The resumed half was not fetched again. The torn partial was resumed, failed its hash and
    # was fetched whole: it cost its size minus the 100 bytes it already had, once more.
    assert chunk_bytes(registry_server) == man.total_bytes - len(half) + corrupt.size - 100


def test_server_ignoring_range_still_resumes_correctly(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    man = publisher.publish(model, "1").manifest
    registry_server.honour_range = False
    registry_server.cut_at([man.total_bytes // 2])
    get(registry_server, tmp_path / "state", "1", fast_transfers, upstream_key)
    assert_active(tmp_path / "state", "1", model, upstream_key)


def test_transient_errors_are_retried_and_persistent_ones_give_up(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    publisher.publish(model, "1")
    registry_server.fail_next(3, 503, path="/chunks/")
    registry_server.fail_next(1, 500, path="manifest.json")
    get(registry_server, tmp_path / "ok", "1", fast_transfers, upstream_key)
    assert_active(tmp_path / "ok", "1", model, upstream_key)
    assert sum(r.status >= 500 for r in registry_server.requests) == 4

    registry_server.fail_next(50, 503, path="/chunks/")
    cfg = fast_transfers.model_copy(update={"retries": 2, "connections": 1})
    with pytest.raises(FetchFailedError, match="gave up after 3 attempts"):
        get(registry_server, tmp_path / "fail", "1", cfg, upstream_key)
    assert ModelSlots(tmp_path / "fail", "digits").active() is None


def test_read_timeout_triggers_a_retry_instead_of_hanging(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    publisher.publish(model, "1")
    registry_server.stall_next(1, 10.0)
    cfg = fast_transfers.model_copy(update={"read_timeout_s": 0.3})
    start = time.monotonic()
    get(registry_server, tmp_path / "state", "1", cfg, upstream_key)
    assert time.monotonic() - start < 5.0  # the 10 s stall was cut short by the read timeout
    assert_active(tmp_path / "state", "1", model, upstream_key)


def test_unreachable_registry_fails_after_retries(upstream_key: Any, tmp_path: Path,
                                                  fast_transfers: TransferConfig) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = fast_transfers.model_copy(update={"retries": 2})
    with pytest.raises(FetchFailedError, match="cannot connect"):
        update(parse_ref("digits@1", f"http://127.0.0.1:{port}"), state_dir=tmp_path / "s",
               trusted=trusted(upstream_key), cfg=cfg)


def test_bandwidth_cap_paces_the_download(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    man = publisher.publish(new_model(), "1").manifest
    rate = 1 << 20
    cfg = fast_transfers.model_copy(update={"max_bytes_per_s": rate})
    start = time.monotonic()
    pull(parse_ref("digits@1", registry_server.url), state_dir=tmp_path / "s",
         trusted=trusted(upstream_key), cfg=cfg)
    # The bucket allows a 100 ms burst; everything beyond that is paced at the cap.
    assert time.monotonic() - start >= man.total_bytes / rate - 0.1 - 0.05


def test_not_enough_disk_is_reported_before_any_chunk_moves(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    publisher.publish(new_model(), "1")
    cfg = fast_transfers.model_copy(update={"free_disk_margin_bytes": 1 << 60})
    with pytest.raises(InsufficientDiskError, match=r"needs \d+ MiB .* MiB available"):
        get(registry_server, tmp_path / "s", "1", cfg, upstream_key)
    assert registry_server.chunk_requests() == []


# ---------------------------------------------------------------------------------------------
# Refusals: each with its own error; the active model stays active and loadable.


def resign(root: Path, version: str, key: SigningKey, edit: Callable[[dict], None]) -> None:
    """What a registry insider with a trusted key (or a bug upstream) could serve."""
    path = root / f"digits/{version}/manifest.json"
    doc = json.loads(path.read_bytes())
    edit(doc)
    body = json.dumps(doc, indent=1).encode()
    path.write_bytes(body)
    (root / f"digits/{version}/manifest.sig").write_bytes(key.sign_manifest(body))


def add_artefact(root: Path, doc: dict, path: str, data: bytes) -> None:
    sha = hashlib.sha256(data).hexdigest()
    (root / chunk_key(sha)).parent.mkdir(parents=True, exist_ok=True)
    (root / chunk_key(sha)).write_bytes(data)
    end = sum(c["size"] for c in doc["chunks"])
    doc["chunks"].append({"sha256": sha, "size": len(data)})
    doc["artefacts"].append({"path": path, "offset": end, "nbytes": len(data), "sha256": sha})


def torch_pickle() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"weight": torch.zeros(3)}, buf)
    return buf.getvalue()


def _flip_new_chunk(ctx: dict) -> None:
    sha = next(iter(ctx["new_chunks"]))
    p = ctx["root"] / chunk_key(sha)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _truncate_new_chunk(ctx: dict) -> None:
    p = ctx["root"] / chunk_key(next(iter(ctx["new_chunks"])))
    p.write_bytes(p.read_bytes()[:-10])


def _unknown_key(ctx: dict) -> None:
    intruder = ctx["make_keypair"]("intruder").signing
    resign(ctx["root"], "2", intruder, lambda d: None)


def _tamper(ctx: dict) -> None:
    p = ctx["root"] / "digits/2/manifest.json"
    p.write_bytes(p.read_bytes().replace(b'"eval/acc": 0.5', b'"eval/acc": 0.9'))


def _unsigned(ctx: dict) -> None:
    (ctx["root"] / "digits/2/manifest.sig").unlink()


def _escape(ctx: dict) -> None:
    resign(ctx["root"], "2", ctx["key"], lambda d: d["tensors"][0].update(name="../../etc/x"))


def _pickle_artefact(ctx: dict) -> None:
    resign(ctx["root"], "2", ctx["key"],
           lambda d: add_artefact(ctx["root"], d, "model.safetensors", torch_pickle()))


def _pt_artefact(ctx: dict) -> None:
    resign(ctx["root"], "2", ctx["key"],
           lambda d: add_artefact(ctx["root"], d, "weights.pt", torch_pickle()))


def _spec(ctx: dict) -> None:
    resign(ctx["root"], "2", ctx["key"], lambda d: d["model"]["kwargs"].update(hidden=[128] * 7))


def _tensor_hash(ctx: dict) -> None:
    resign(ctx["root"], "2", ctx["key"], lambda d: d["tensors"][3].update(sha256="0" * 64))


def _wrong_version(ctx: dict) -> None:
    for f in ("manifest.json", "manifest.sig"):
        shutil.copy(ctx["root"] / "digits/1" / f, ctx["root"] / "digits/2" / f)


REFUSALS = [
    # (corruption, error, message, chunks may move before the refusal)
    (_flip_new_chunk, ChunkHashError, "registry's copy is corrupt", True),
    (_truncate_new_chunk, TruncatedError, "truncated", True),
    (_unknown_key, UnknownKeyError, "not trusted", False),
    (_tamper, BadSignatureError, "altered after signing", False),
    (_unsigned, UnsignedManifestError, "unsigned", False),
    (_escape, UnsafeNameError, r"'\.\./\.\./etc/x' is refused", False),
    (_pickle_artefact, PickleRefusedError, "torch.save", True),
    (_pt_artefact, PickleRefusedError, "pickle container", False),
    (_spec, SpecMismatchError, "unexpected tensor", False),
    (_tensor_hash, TensorHashError, "every chunk verified", True),
    (_wrong_version, ManifestMismatchError, "asked for digits@2", False),
]


@pytest.mark.parametrize(("corrupt", "error", "message", "chunks_move"), REFUSALS,
                         ids=[r[0].__name__.strip("_") for r in REFUSALS])
def test_refused_versions_leave_the_active_model_untouched(
    new_model: Any, make_keypair: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path, corrupt: Callable[[dict], None],
    error: type[Exception], message: str, chunks_move: bool,
) -> None:
    v1 = new_model()
    m1 = publisher.publish(v1, "1").manifest
    state = tmp_path / "state"
    get(registry_server, state, "1", fast_transfers, upstream_key)
    m2 = publisher.publish(perturbed(v1, ["3.weight"]), "2", parent="1").manifest
    new_chunks = {c.sha256 for c in m2.chunks} - {c.sha256 for c in m1.chunks}
    corrupt({"root": publisher.root, "key": upstream_key.signing, "make_keypair": make_keypair,
             "new_chunks": new_chunks})
    registry_server.reset()

    with pytest.raises(error, match=message):
        get(registry_server, state, "2", fast_transfers, upstream_key)
    if not chunks_move:  # refused on the manifest alone: verification comes before any chunk
        assert registry_server.chunk_requests() == []
    assert_active(state, "1", v1, upstream_key)
    assert ModelSlots(state, "digits").standby() is None
    store = ChunkStore(state)
    for sha in store.hashes():  # nothing unverified ever entered the store
        data = store.path(sha).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha


# ---------------------------------------------------------------------------------------------
# The command line, as a script would run it


def test_agentctl_pull_exit_codes(
    new_model: Any, make_keypair: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    model = new_model()
    publisher.publish(model, "1")
    publisher.publish(perturbed(model, ["1.weight"]), "2", parent="1",
                      key=make_keypair("intruder").signing)
    base = [sys.executable, "-m", "agent.cli", "pull", "--registry", registry_server.url,
            "--state-dir", str(tmp_path / "state"), "--trusted-keys", str(upstream_key.trusted_dir)]
    ok = subprocess.run([*base, "digits@1"], capture_output=True, text=True, env=subprocess_env,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "digits@1 active (slot a)" in ok.stdout and ok.stderr == ""  # no bar off a TTY
    refused = subprocess.run([*base, "digits@2"], capture_output=True, text=True,
                             env=subprocess_env, timeout=120)
    assert refused.returncode == 3 and "refused (UnknownKeyError)" in refused.stderr
    assert_active(tmp_path / "state", "1", model, upstream_key)


def test_pull_from_s3(new_model: Any, publisher: Any, upstream_key: Any, tmp_path: Path,
                      fast_transfers: TransferConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    moto = pytest.importorskip("moto", reason="S3 round trip needs moto (pip install moto boto3)")
    import boto3

    from registry.stores import open_store

    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    model = new_model()
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="models")
        publisher.publish(model, "1", store=open_store("s3://models/reg"))
        update(parse_ref("s3://models/reg/digits/1"), state_dir=tmp_path / "state",
               trusted=trusted(upstream_key), cfg=fast_transfers)
    assert_active(tmp_path / "state", "1", model, upstream_key)
