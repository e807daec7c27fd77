"""python -m registry.serve: a real subprocess serving a registry folder that devices pull from
(with resumable ranges) and that upstream and devices upload to, each with its own token."""

from __future__ import annotations

import http.client
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from registry.errors import FetchFailedError, VersionExistsError
from registry.names import chunk_key
from registry.principals import hash_token
from registry.pull import fetch_verified_manifest
from registry.refs import Ref
from registry.signing import generate_keypair, load_signing_key, load_trusted_keys
from tests.support.registry_serve import (
    MODEL,
    ServedRegistry,
    fast,
    make_contents,
    serve_registry,
)

BLOB = bytes(range(256)) * 4


@pytest.fixture(scope="module")
def contents(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return make_contents(tmp_path_factory.mktemp("checkpoints"), 9)


@pytest.fixture
def plain(tmp_path: Path, subprocess_env: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """registry.serve without principals: read-only."""
    import hashlib

    root = tmp_path / "registry"
    (root / chunk_key(hashlib.sha256(BLOB).hexdigest())).parent.mkdir(parents=True)
    (root / chunk_key(hashlib.sha256(BLOB).hexdigest())).write_bytes(BLOB)
    (root / "notes.txt").write_text("not a registry object")
    proc = subprocess.Popen([sys.executable, "-m", "registry.serve", str(root)],
                            env=subprocess_env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url, root
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def served(tmp_path: Path, subprocess_env: dict[str, str]) -> Iterator[ServedRegistry]:
    with serve_registry(tmp_path, subprocess_env) as reg:
        yield reg


def request(url: str, method: str, path: str, headers: dict[str, str] | None = None,
            body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_ranges_resume_and_refuse(plain: tuple[str, Path]) -> None:
    import hashlib

    url, _ = plain
    path = "/" + chunk_key(hashlib.sha256(BLOB).hexdigest())
    status, headers, body = request(url, "GET", path)
    assert (status, body) == (200, BLOB)
    assert headers["Accept-Ranges"] == "bytes"
    status, headers, body = request(url, "GET", path, {"Range": "bytes=1000-"})
    assert (status, body) == (206, BLOB[1000:])
    assert headers["Content-Range"] == f"bytes 1000-{len(BLOB) - 1}/{len(BLOB)}"
    status, _, body = request(url, "GET", path, {"Range": "bytes=-10"})
    assert (status, body) == (206, BLOB[-10:])
    assert request(url, "GET", path, {"Range": "bytes=5000-"})[0] == 416
    assert request(url, "GET", "/digits/1/manifest.json")[0] == 404
    # Only the registry's layout is served: not other files, not the server's own state.
    assert request(url, "GET", "/notes.txt")[0] == 404
    assert request(url, "GET", "/.serve/pending/x")[0] == 404
    assert request(url, "GET", "/../etc/passwd")[0] == 400


def test_without_principals_it_is_read_only(plain: tuple[str, Path]) -> None:
    url, root = plain
    before = sorted(p for p in root.rglob("*") if ".serve" not in p.parts)
    status, _, body = request(url, "PUT", "/digits/1/manifest.json", body=b"{}")
    assert status == 403 and b"read-only" in body
    assert sorted(p for p in root.rglob("*") if ".serve" not in p.parts) == before


def test_upstream_publishes_a_device_pulls_and_uploads_its_own_version(
    served: ServedRegistry, contents: list[Any], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    served.publish(contents[0], "1")
    state = tmp_path / "state"
    run = subprocess.run(
        [sys.executable, "-m", "agent.cli", "pull", f"{MODEL}@1", "--registry", served.url,
         "--state-dir", str(state), "--trusted-keys", str(served.trusted), "--no-progress"],
        env=subprocess_env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr

    report = served.upload(contents[1], "dev-a")
    child = report.manifest
    assert child.version.startswith("1+dev-a.") and child.parent == "1"
    assert child.sequence == 2 and child.signer.name == "dev-a"
    got = fetch_verified_manifest(served.store(), Ref(MODEL, child.version, served.url),
                                  load_trusted_keys(served.trusted), fast())
    assert got.key.name == "dev-a" and got.manifest == child
    # The counter is the server's; the publisher's own write of it was taken as a no-op.
    assert yaml.safe_load((served.root / MODEL / "_sequence.json").read_text()) == {
        "sequence": 2, "version": child.version}
    # Versions are immutable: the same upload again is refused before a byte moves.
    with pytest.raises(VersionExistsError):
        served.upload(contents[1], "dev-a", version=child.version)


def test_eight_devices_upload_at_once_and_get_distinct_sequences(
    tmp_path: Path, subprocess_env: dict[str, str], contents: list[Any],
) -> None:
    devices = [f"dev-{i}" for i in range(8)]
    with serve_registry(tmp_path, subprocess_env, devices) as reg:
        reg.publish(contents[0], "1")
        results: dict[str, Any] = {}
        gate = threading.Barrier(len(devices))

        def upload(i: int) -> None:
            gate.wait()
            try:
                results[devices[i]] = reg.upload(contents[i + 1], devices[i]).manifest
            except Exception as e:  # reported below, with the device's name
                results[devices[i]] = e

        threads = [threading.Thread(target=upload, args=(i,)) for i in range(len(devices))]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        took = time.monotonic() - start
        failed = {d: r for d, r in results.items() if isinstance(r, Exception)}
        assert not failed and len(results) == 8, failed
        # Every upload raced for sequence 2; the server let exactly one have each number.
        assert sorted(m.sequence for m in results.values()) == list(range(2, 10)), took
        assert yaml.safe_load((reg.root / MODEL / "_sequence.json").read_text())["sequence"] == 9
        trusted = load_trusted_keys(reg.trusted)
        for dev, m in results.items():
            got = fetch_verified_manifest(reg.store(), Ref(MODEL, m.version, reg.url), trusted,
                                          fast())
            assert got.key.name == dev and got.manifest.sequence == m.sequence
        print(f"8 concurrent device uploads: {took:.2f} s, sequences 2..9")


def test_add_principal_mints_a_token_the_running_server_accepts(
    served: ServedRegistry, contents: list[Any], tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    """A device added while the server runs: the documented command, then its key."""
    served.publish(contents[0], "1")
    principals = tmp_path / "provision" / "principals.yaml"
    token_file = tmp_path / "dev-new.token"
    run = subprocess.run(
        [sys.executable, "-m", "registry.serve", "add-principal", "--principals",
         str(principals), "--name", "dev-new", "--kind", "device", "--token-out",
         str(token_file)],
        env=subprocess_env, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "device dev-new" in run.stdout and "NAME@*+dev-new.*" in run.stdout
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    text = principals.read_text()
    assert token not in text and hash_token(token) in text  # the server keeps only the hash
    # Minting again into the same file would silently replace a credential: refused.
    again = subprocess.run(
        [sys.executable, "-m", "registry.serve", "add-principal", "--principals",
         str(principals), "--name", "dev-other", "--kind", "device", "--token-out",
         str(token_file)], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "never overwritten" in again.stderr

    priv, pub = generate_keypair(tmp_path / "keys", "dev-new", [f"{MODEL}@*+dev-new.*"])
    (served.trusted / "dev-new.scope").write_bytes((tmp_path / "keys/dev-new.scope").read_bytes())
    (served.trusted / pub.name).write_bytes(pub.read_bytes())
    from tests.support.registry_serve import Principal

    served.who["dev-new"] = Principal("dev-new", load_signing_key(priv), token)
    time.sleep(1.2)  # the server looks for changed files at most once a second
    assert served.upload(contents[2], "dev-new").manifest.signer.name == "dev-new"


def test_private_reads_need_a_token_and_the_client_answers_the_challenge(
    tmp_path: Path, subprocess_env: dict[str, str], contents: list[Any],
) -> None:
    with serve_registry(tmp_path, subprocess_env, ["dev-a"], "--private-reads") as reg:
        reg.publish(contents[0], "1")
        status, headers, _ = request(reg.url, "GET", f"/{MODEL}/1/manifest.json")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        ref, trusted = Ref(MODEL, "1", reg.url), load_trusted_keys(reg.trusted)
        with pytest.raises(FetchFailedError, match="401"):
            fetch_verified_manifest(reg.store(), ref, trusted, fast())
        got = fetch_verified_manifest(reg.store("dev-a"), ref, trusted, fast())
        assert got.manifest.sequence == 1
