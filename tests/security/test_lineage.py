"""A device key can never mint an upstream release.

A device's key is scoped to its own versions (``digits@*+dev-a.*``). Inside that scope it
could sign a manifest naming no ``base`` with any sequence; a device taking it for an upstream
release would move its anti-rollback record to that sequence and refuse every real release
below it. Each test sends such a version through the public doors: the real
``python -m registry.serve`` on loopback (its upload rules) and a device's ``agentctl pull``
from a registry that serves it anyway (a hostile mirror: plain files over loopback HTTP). The
rule: a version a device-scoped key signs must name an upstream base that verifies against an
upstream key (``registry.lineage``). And after every refused attempt the real upstream
release still installs: no downgrade lock-out.
"""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main as agentctl
from agent.storage.chunk_store import ChunkStore
from agent.storage.slots import ModelSlots
from agent.storage.verify import BASE_MANIFEST, verify_slot
from registry.errors import LineageError
from registry.manifest import BaseRelease, ChunkRef
from registry.names import chunk_key, manifest_key, sequence_key, signature_key
from registry.publish import SignedVersion, sign_version
from registry.signing import load_trusted_keys
from registry.stores import LocalStore
from tests.support.registry_serve import MODEL, ServedRegistry, make_contents, serve_registry
from tests.support.registry_server import RegistryServer

FORGED_SEQUENCE = 1000
"""What a forged 'release' claims: far above anything upstream has published."""


@pytest.fixture(scope="module")
def contents(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return make_contents(tmp_path_factory.mktemp("checkpoints"), 4)


@pytest.fixture
def reg(tmp_path: Path, subprocess_env: dict[str, str],
        contents: list[Any]) -> Iterator[ServedRegistry]:
    """The registry with upstream's digits@1 published through it; devices dev-a, dev-b."""
    with serve_registry(tmp_path / "served", subprocess_env) as r:
        r.publish(contents[0], "1")
        yield r


@pytest.fixture
def device(reg: ServedRegistry, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A device's state dir with upstream's digits@1 installed by ``agentctl pull``; it trusts
    what the registry trusts (upstream, and dev-a and dev-b within their scopes)."""
    state = tmp_path / "device"
    assert pull(state, reg.url, "1", reg) == 0, capsys.readouterr().err
    return state


def pull(state: Path, url: str, version: str, reg: ServedRegistry, *extra: str) -> int:
    return agentctl(["pull", f"{MODEL}@{version}", "--registry", url, "--state-dir", str(state),
                     "--trusted-keys", str(reg.trusted), "--no-progress", "--retries", "1",
                     *extra])


@dataclass(frozen=True)
class Forged:
    signed: SignedVersion
    chunks: list[tuple[ChunkRef, bytes]]

    @property
    def version(self) -> str:
        return self.signed.manifest.version


def forge(reg: ServedRegistry, who: str, version: str, content: Any,
          base: BaseRelease | None, sequence: int = FORGED_SEQUENCE) -> Forged:
    """``who``'s key signs ``version`` (inside its scope) with ``base`` and ``sequence``."""
    chunks: list[tuple[ChunkRef, bytes]] = []
    signed = sign_version(name=MODEL, version=version, sequence=sequence, model=content.model,
                          tensors=content.tensors, key=reg.who[who].key,
                          on_chunk=lambda ref, data: chunks.append((ref, bytes(data))),
                          parent="1", base=base, chunk_size=16 << 10, pack_below=4 << 10)
    return Forged(signed, chunks)


def next_sequence(reg: ServedRegistry) -> int:
    """The sequence the registry takes next: a forged upload signs it, so the only reason left
    to refuse it is its lineage."""
    return int(json.loads((reg.root / sequence_key(MODEL)).read_bytes())["sequence"]) + 1


def put(reg: ServedRegistry, who: str, key: str, body: bytes) -> tuple[int, str]:
    """A raw PUT as ``who`` (its own token), bypassing the client's own checks."""
    host, port = reg.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("PUT", "/" + key, body=body,
                     headers={"Authorization": f"Bearer {reg.who[who].token}"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def upload_raw(reg: ServedRegistry, who: str, forged: Forged) -> tuple[int, str]:
    """Everything an uploader sends, in order (chunks, signature, manifest), as ``who``;
    returns the manifest's answer."""
    for ref, data in forged.chunks:
        status, body = put(reg, who, chunk_key(ref.sha256), data)
        assert status in (200, 201), body
    status, body = put(reg, who, signature_key(MODEL, forged.version),
                       forged.signed.signature_bytes)
    assert status == 201, body
    return put(reg, who, manifest_key(MODEL, forged.version), forged.signed.manifest_bytes)


@pytest.fixture
def mirror(reg: ServedRegistry, tmp_path: Path) -> Iterator[tuple[LocalStore, str]]:
    """A hostile registry: a copy of the real one's objects over plain loopback HTTP, into
    which anything can be written (no upload rules)."""
    root = tmp_path / "mirror"
    shutil.copytree(reg.root, root, ignore=shutil.ignore_patterns(".serve"))
    with RegistryServer(root) as server:
        yield LocalStore(root), server.url


def plant(store: LocalStore, forged: Forged) -> None:
    for ref, data in forged.chunks:
        store.put(chunk_key(ref.sha256), data)
    store.put(signature_key(MODEL, forged.version), forged.signed.signature_bytes)
    store.put(manifest_key(MODEL, forged.version), forged.signed.manifest_bytes)


def record(state: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((state / "models/digits/installed.json").read_text())
    return data


def still_takes_upstream(reg: ServedRegistry, state: Path, contents: list[Any],
                         capsys: pytest.CaptureFixture[str]) -> None:
    """The registry's counter is out of no one's reach, and upstream's next release still
    installs on the device: no downgrade lock-out."""
    counter = json.loads((reg.root / sequence_key(MODEL)).read_bytes())["sequence"]
    assert counter < 10
    release = reg.publish(contents[3], "2", parent="1").manifest
    assert release.sequence == counter + 1
    capsys.readouterr()
    assert pull(state, reg.url, "2", reg) == 0, capsys.readouterr().err
    assert ModelSlots(state, MODEL).active().version == "2"  # type: ignore[union-attr]
    assert record(state)["base_sequence"] == release.sequence


# -- the attack: a base-less "release" signed by a device key --------------------------------


def test_a_device_signed_release_without_base_is_refused_everywhere(
    reg: ServedRegistry, device: Path, mirror: tuple[LocalStore, str], contents: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The registry server: refused, 403, saying why; nothing stored.
    before = reg.snapshot()
    status, body = upload_raw(reg, "dev-a", forge(reg, "dev-a", "9+dev-a.release", contents[1],
                                                  base=None, sequence=next_sequence(reg)))
    assert status == 403 and "names no upstream base" in body, (status, body)
    assert "device key can never make an upstream release" in body
    after = reg.snapshot()
    assert {k: v for k, v in after.items() if not k.startswith("chunks/")} == {
        k: v for k, v in before.items() if not k.startswith("chunks/")}

    # A device pulling it from a registry that serves it anyway, with a sequence far above
    # upstream's: refused (exit 3), even with --allow-downgrade; the record and the slots
    # are untouched.
    forged = forge(reg, "dev-a", "9+dev-a.release", contents[1], base=None)
    store, url = mirror
    plant(store, forged)
    was = record(device)
    for extra in ((), ("--allow-downgrade",)):
        capsys.readouterr()
        assert pull(device, url, "9+dev-a.release", reg, *extra) == 3
        err = capsys.readouterr().err
        assert "dev-a" in err and "names no upstream base" in err, err
    slots = ModelSlots(device, MODEL)
    assert slots.active().version == "1" and slots.standby() is None  # type: ignore[union-attr]
    assert record(device) == was

    # The slots themselves refuse it, whoever calls them (the deploy job's stage).
    key = next(k for k in load_trusted_keys(reg.trusted).values() if k.name == "dev-a")
    with pytest.raises(LineageError, match="names no upstream base"):
        slots.stage(forged.signed.manifest, forged.signed.manifest_bytes,
                    forged.signed.signature_bytes, ChunkStore(device), key)
    assert slots.standby() is None
    still_takes_upstream(reg, device, contents, capsys)


def test_a_base_signed_by_another_device_is_refused(
    reg: ServedRegistry, device: Path, mirror: tuple[LocalStore, str], contents: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """dev-b's own (legitimate) fine-tune is in the registry; dev-a names it as its base."""
    theirs = reg.upload(contents[1], "dev-b").manifest
    assert theirs.base == BaseRelease(version="1", sequence=1)
    forged = forge(reg, "dev-a", "1+dev-a.chained", contents[2],
                   base=BaseRelease(version=theirs.version, sequence=theirs.sequence),
                   sequence=next_sequence(reg))
    status, body = upload_raw(reg, "dev-a", forged)
    assert status == 403 and "not an upstream release" in body, (status, body)
    assert not (reg.root / MODEL / "1+dev-a.chained").exists()

    store, url = mirror
    # The mirror holds all the registry does (dev-b's version too), and the forged child.
    shutil.copytree(reg.root, store.root, ignore=shutil.ignore_patterns(".serve"),
                    dirs_exist_ok=True)
    plant(store, forged)
    capsys.readouterr()
    assert pull(device, url, "1+dev-a.chained", reg) == 3
    err = capsys.readouterr().err
    assert "dev-b" in err and "not an upstream release" in err, err
    assert ModelSlots(device, MODEL).active().version == "1"  # type: ignore[union-attr]
    still_takes_upstream(reg, device, contents, capsys)


def test_a_base_that_is_not_the_upstream_release_it_claims_is_refused(
    reg: ServedRegistry, device: Path, mirror: tuple[LocalStore, str], contents: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A base no registry holds (digits@7), or upstream's digits@1 with another sequence."""
    store, url = mirror
    cases = [
        ("1+dev-a.nobase", BaseRelease(version="7", sequence=7), 409,
         "is not an upstream release in this registry", "does not hold"),
        ("1+dev-a.wrongseq", BaseRelease(version="1", sequence=5), 403,
         "the upstream release has sequence 1", "with sequence 1"),
    ]
    for version, base, code, server_says, device_says in cases:
        forged = forge(reg, "dev-a", version, contents[1], base=base,
                       sequence=next_sequence(reg))
        status, body = upload_raw(reg, "dev-a", forged)
        assert status == code and server_says in body, (version, status, body)
        assert not (reg.root / MODEL / version).exists()
        plant(store, forged)
        capsys.readouterr()
        assert pull(device, url, version, reg) == 3, version
        err = capsys.readouterr().err
        assert device_says in err, (version, err)
    assert ModelSlots(device, MODEL).active().version == "1"  # type: ignore[union-attr]
    assert record(device)["base_sequence"] == 1
    still_takes_upstream(reg, device, contents, capsys)


# -- what still works ----------------------------------------------------------------------


def test_a_device_fine_tune_of_a_verified_release_is_accepted(
    reg: ServedRegistry, device: Path, contents: list[Any], capsys: pytest.CaptureFixture[str],
) -> None:
    """dev-a's upload of a fine-tune of digits@1: stored by the server, installed by a device
    with its base's signed manifest kept in the slot and re-verified from it; the record
    counts it within release 1, so upstream's release 2 still installs after it."""
    mine = reg.upload(contents[1], "dev-a").manifest
    assert mine.base == BaseRelease(version="1", sequence=1) and mine.sequence == 2
    assert pull(device, reg.url, mine.version, reg) == 0, capsys.readouterr().err
    slots = ModelSlots(device, MODEL)
    active = slots.active()
    assert active is not None and active.version == mine.version and active.device_signed
    assert (active.path / BASE_MANIFEST).read_bytes() == (
        reg.root / manifest_key(MODEL, "1")).read_bytes()
    verify_slot(active.path, load_trusted_keys(reg.trusted))
    assert record(device)["base_sequence"] == 1 and record(device)["lineage_sequence"] == 2
    # Its kept base is what vouches for it: swapped for dev-b's version, it is refused.
    theirs = reg.upload(contents[2], "dev-b").manifest
    shutil.copy(reg.root / manifest_key(MODEL, theirs.version), active.path / BASE_MANIFEST)
    shutil.copy(reg.root / signature_key(MODEL, theirs.version),
                active.path / "base.manifest.sig")
    with pytest.raises(LineageError, match="not an upstream release"):
        verify_slot(active.path, load_trusted_keys(reg.trusted))
    still_takes_upstream(reg, device, contents, capsys)
