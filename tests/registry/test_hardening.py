"""The registry against a misbehaving loopback server and a tampered state dir (issue 8, item 5):
rollback, slow retrieval, malformed JSON, key scope, planted symlinks, broken resume, and the
read timeout after http.client reconnects by itself."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.cli import main as agentctl
from agent.storage.chunk_store import ChunkStore
from agent.storage.gc import gc
from agent.storage.lock import StateLock
from agent.storage.slots import ModelSlots
from agent.storage.update import update
from registry.errors import (
    BadSignatureError,
    DeadlineExceededError,
    DowngradeError,
    FetchFailedError,
    InvalidManifestError,
    KeyScopeError,
    UnsafeStateError,
    UnsignedManifestError,
)
from registry.refs import parse_ref
from registry.signing import load_trusted_keys
from registry.transfer import TransferConfig


def pull(server: Any, state: Path, version: str, cfg: TransferConfig, trusted_dir: Path) -> Any:
    return update(parse_ref(f"digits@{version}", server.url), state_dir=state,
                  trusted=load_trusted_keys(trusted_dir), cfg=cfg)


def changed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    new = copy.deepcopy(model)
    with torch.no_grad():
        new[1].weight.add_(float(seed))
    return new


# ---------------------------------------------------------------------------------------------
# Rollback (downgrade) attack


def test_an_older_signed_version_is_refused_unless_asked_for(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    model = new_model()
    # "10" sorts before "9" as a string: only the signed sequence orders versions.
    publisher.publish(model, "9")
    publisher.publish(changed(model, 1), "10", parent="9")
    state, keys = tmp_path / "state", upstream_key.trusted_dir
    pull(registry_server, state, "10", fast_transfers, keys)
    registry_server.reset()
    with pytest.raises(DowngradeError, match="sequence 1, below 2"):
        pull(registry_server, state, "9", fast_transfers, keys)
    assert registry_server.chunk_requests() == []  # refused before any chunk moved
    assert ModelSlots(state, "digits").active().version == "10"  # type: ignore[union-attr]

    # The CLI refuses with exit 3; --allow-downgrade installs it, logged.
    args = ["pull", "digits@9", "--registry", registry_server.url, "--state-dir", str(state),
            "--trusted-keys", str(keys), "--no-progress"]
    assert agentctl(args) == 3
    with caplog.at_level(logging.WARNING, logger="agent.storage"):
        assert agentctl([*args, "--allow-downgrade"]) == 0
    assert any(getattr(r, "fields", {}).get("event") == "downgrade" for r in caplog.records)
    slots = ModelSlots(state, "digits")
    assert slots.active().version == "9" and slots.highest_sequence() == 2  # type: ignore[union-attr]

    # An explicit rollback to the verified standby slot is the other way back, also logged.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agent.storage"):
        slots.rollback(load_trusted_keys(keys))
    assert slots.active().version == "10"  # type: ignore[union-attr]
    assert any(getattr(r, "fields", {}).get("event") == "rollback" for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# Slow retrieval


def test_a_server_dripping_one_byte_per_second_fails_within_the_deadline(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    publisher.publish(new_model(), "1")
    registry_server.drip_bytes_per_s = 1.0
    cfg = fast_transfers.model_copy(update={
        "request_deadline_s": 2.0, "read_timeout_s": 5.0, "min_rate_window_s": 1.0,
    })
    state = tmp_path / "state"
    start = time.monotonic()
    with pytest.raises(FetchFailedError) as err:
        pull(registry_server, state, "1", cfg, upstream_key.trusted_dir)
    held = time.monotonic() - start
    # Headers and body trickle in: no read ever times out; the deadline ends it at 2 s.
    assert isinstance(err.value, DeadlineExceededError) and "2 s deadline" in str(err.value)
    assert held < 2.0 * 1.1, held
    with StateLock(state, wait_s=0):  # released: the next pull is not locked out
        pass


def test_a_dripping_header_is_cut_by_the_deadline_not_the_read_timeout(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    """Header bytes trickling in never trip a read timeout, nor the body's minimum rate: only
    the watchdog on the deadline ends the request."""
    publisher.publish(new_model(), "1")
    registry_server.drip_bytes_per_s = 4.0
    cfg = fast_transfers.model_copy(update={
        "request_deadline_s": 1.5, "read_timeout_s": 30.0, "min_rate_bytes_per_s": 0,
    })
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        pull(registry_server, tmp_path / "state", "1", cfg, upstream_key.trusted_dir)
    assert time.monotonic() - start < 1.5 * 1.1


# ---------------------------------------------------------------------------------------------
# Malformed JSON


@pytest.mark.parametrize(("target", "payload", "error", "message"), [
    ("manifest.sig", b"[" * 4000, UnsignedManifestError, "nested 4000 levels"),
    ("manifest.sig", b'{"format": "edgetrain.sig/1", "format": "x"}', UnsignedManifestError,
     "appears twice"),
    ("manifest.sig", b'{"key_id": 1' + b"0" * 3000 + b"}", UnsignedManifestError,
     "3001 characters"),
    # The signature is checked over the raw bytes first: garbage there fails it, no parse.
    ("manifest.json", b"{" * 3000, BadSignatureError, "altered after signing"),
])
def test_malformed_json_is_refused_with_a_clear_error(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path, target: str, payload: bytes,
    error: type[Exception], message: str,
) -> None:
    publisher.publish(new_model(), "1")
    (publisher.root / "digits/1" / target).write_bytes(payload)
    with pytest.raises(error, match=message):
        pull(registry_server, tmp_path / "state", "1", fast_transfers, upstream_key.trusted_dir)


def test_a_validly_signed_manifest_with_hostile_json_is_refused_through_the_cli(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any, tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    """The signer's key signs anything; the parser still refuses duplicate keys, absurd numbers
    and deep nesting, with exit 3 and one line, never a traceback."""
    publisher.publish(new_model(), "1")
    mpath = publisher.root / "digits/1/manifest.json"
    good = mpath.read_bytes()
    bodies = [
        good.replace(b'{\n "artefacts"', b'{\n "name": "evil",\n "artefacts"', 1),
        good.replace(b'"sequence": 1', b'"sequence": 1' + b"0" * 5000, 1),
        good.replace(b'"metrics": {', b'"metrics": {"x": ' + b"[" * 2000 + b"]" * 2000 + b", ", 1),
    ]
    for body in bodies:
        assert body != good
        mpath.write_bytes(body)
        (mpath.parent / "manifest.sig").write_bytes(upstream_key.signing.sign_manifest(body))
        done = subprocess.run(
            [sys.executable, "-m", "agent.cli", "pull", "digits@1", "--registry",
             registry_server.url, "--state-dir", str(tmp_path / "state"), "--trusted-keys",
             str(upstream_key.trusted_dir)],
            capture_output=True, text=True, env=subprocess_env, timeout=120,
        )
        assert done.returncode == 3, done.stderr
        assert "refused (MalformedJsonError)" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(InvalidManifestError):
        from registry.manifest import Manifest

        Manifest.from_bytes(bodies[0])


# ---------------------------------------------------------------------------------------------
# Key scope


def test_a_device_key_signs_only_its_own_uploads(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any, make_keypair: Any,
    fast_transfers: TransferConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    model = new_model()
    device = make_keypair("jetson-07")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    for pub in (upstream_key.public_path, device.public_path):
        shutil.copy(pub, trusted / pub.name)
    (trusted / "jetson-07.scope").write_text("# its own uploads only\ndigits@*+jetson-07.*\n")
    publisher.publish(model, "1")
    publisher.publish(changed(model, 1), "2", parent="1", key=device.signing)  # not its own
    publisher.publish(changed(model, 2), "1+jetson-07.x", parent="1", key=device.signing,
                      base="1")
    state = tmp_path / "state"
    pull(registry_server, state, "1", fast_transfers, trusted)
    with pytest.raises(KeyScopeError, match=r"jetson-07.*does not cover it"):
        pull(registry_server, state, "2", fast_transfers, trusted)
    pull(registry_server, state, "1+jetson-07.x", fast_transfers, trusted)

    # `models` names the key that verified the version: a manifest claiming another signer
    # does not change it.
    capsys.readouterr()
    assert agentctl(["models", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert f"verified by jetson-07 ({device.signing.key_id})" in out


def test_a_manifest_claiming_another_signer_shows_the_verifying_key(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any, make_keypair: Any,
    fast_transfers: TransferConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    other = make_keypair("other")
    publisher.publish(new_model(), "1", key=other.signing)
    mpath = publisher.root / "digits/1/manifest.json"
    doc = json.loads(mpath.read_bytes())
    doc["signer"] = {"key_id": upstream_key.signing.key_id, "name": "upstream"}  # a lie
    body = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    mpath.write_bytes(body)
    (mpath.parent / "manifest.sig").write_bytes(other.signing.sign_manifest(body))
    state = tmp_path / "state"
    pull(registry_server, state, "1", fast_transfers, other.trusted_dir)
    capsys.readouterr()
    assert agentctl(["models", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert f"verified by other ({other.signing.key_id})" in out and "upstream" not in out


# ---------------------------------------------------------------------------------------------
# Symlinks planted in the state dir (CWE-59)


def test_planted_links_are_refused_and_never_followed(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    model = new_model()
    publisher.publish(model, "1")
    publisher.publish(changed(model, 1), "2", parent="1")
    keys = upstream_key.trusted_dir
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")

    # The lock: a link would have the agent truncate the file it points at.
    state = tmp_path / "s1"
    state.mkdir()
    os.symlink(victim / "precious", state / "lock")
    with pytest.raises(UnsafeStateError, match="symbolic link"):
        pull(registry_server, state, "1", fast_transfers, keys)
    assert (victim / "precious").read_text() == "keep me"

    # A chunk fan-out folder: gc would delete "unreferenced" files through it.
    state = tmp_path / "s2"
    pull(registry_server, state, "1", fast_transfers, keys)
    fanout = next((state / "chunks/sha256").iterdir())
    shutil.rmtree(fanout)
    os.symlink(victim, fanout)
    with pytest.raises(UnsafeStateError, match="symbolic link"):
        gc(state)
    assert (victim / "precious").read_text() == "keep me"
    os.unlink(fanout)

    # A partial download: appending would write into the victim.
    m2 = publisher.root / "digits/2/manifest.json"
    new = {c["sha256"] for c in json.loads(m2.read_bytes())["chunks"]} - ChunkStore(state).hashes()
    os.symlink(victim / "precious", ChunkStore(state).partial(sorted(new)[0]))
    with pytest.raises(UnsafeStateError):
        pull(registry_server, state, "2", fast_transfers, keys)
    assert (victim / "precious").read_text() == "keep me"
    gc(state)  # removes the link itself, not its target
    assert (victim / "precious").read_text() == "keep me"

    # A slot: staging would delete the standby slot's files through the link.
    slots = state / "models/digits/slots"
    os.symlink(victim, slots / "b")
    with pytest.raises(UnsafeStateError, match="slot"):
        pull(registry_server, state, "2", fast_transfers, keys)
    assert (victim / "precious").read_text() == "keep me"
    assert ModelSlots(state, "digits").active().version == "1"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# Broken resume, reconnect timeout


@pytest.mark.parametrize("fault", ["resume_from_zero", "resume_wrong_bytes"])
def test_a_resume_answered_wrongly_starts_the_chunk_afresh(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path, fault: str,
) -> None:
    m = publisher.publish(new_model(), "1").manifest
    state = tmp_path / "state"
    big = max(m.chunks, key=lambda c: c.size)
    src = publisher.root / f"chunks/sha256/{big.sha256[:2]}/{big.sha256}"
    store = ChunkStore(state)
    store.partial(big.sha256).parent.mkdir(parents=True)
    store.partial(big.sha256).write_bytes(src.read_bytes()[: big.size // 2])
    setattr(registry_server, fault, True)
    pull(registry_server, state, "1", fast_transfers, upstream_key.trusted_dir)
    assert store.has(big.sha256) and not store.partial(big.sha256).exists()
    ranged = [r for r in registry_server.chunk_requests() if big.sha256 in r.path]
    assert ranged[0].range == f"bytes={big.size // 2}-" and ranged[-1].range == "bytes=0-"


def test_read_timeout_holds_after_http_client_reconnects_by_itself(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any,
    fast_transfers: TransferConfig, tmp_path: Path,
) -> None:
    publisher.publish(new_model(), "1")
    registry_server.close_each_response = True  # every request after the first reconnects
    cfg = fast_transfers.model_copy(update={"connect_timeout_s": 10.0, "read_timeout_s": 0.3,
                                            "connections": 1})
    # Request 1 (manifest) opens the connection; request 2 (signature) goes out on the socket
    # http.client reopened itself. Stalled 3 s, it must time out after 0.3 s and be retried,
    # not wait out the 10 s connect timeout.
    registry_server.faults.stall = [0.0, 3.0]
    start = time.monotonic()
    pull(registry_server, tmp_path / "state", "1", cfg, upstream_key.trusted_dir)
    assert time.monotonic() - start < 2.5
    assert registry_server.faults.stall == []  # the stall was served, and waited out by nobody
