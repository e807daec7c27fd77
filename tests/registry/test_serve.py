"""python -m registry.serve: a real subprocess serving a registry folder that a device pulls
from (with resumable ranges) and uploads to (only with the token)."""

from __future__ import annotations

import http.client
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from registry.stores.http import TOKEN_ENV

TOKEN = "s3cret-token"


@pytest.fixture
def served(tmp_path: Path, subprocess_env: dict[str, str]) -> Iterator[tuple[str, Path]]:
    root = tmp_path / "registry"
    root.mkdir()
    (root / "blob").write_bytes(bytes(range(256)) * 4)
    env = {**subprocess_env, TOKEN_ENV: TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "registry.serve", str(root)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url, root
    finally:
        proc.terminate()
        proc.wait(10)


def _request(url: str, method: str, path: str, headers: dict[str, str] | None = None,
             body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_ranges_resume_and_refuse(served: tuple[str, Path]) -> None:
    url, root = served
    whole = (root / "blob").read_bytes()
    status, headers, body = _request(url, "GET", "/blob")
    assert (status, body) == (200, whole)
    assert headers["Accept-Ranges"] == "bytes"
    status, headers, body = _request(url, "GET", "/blob", {"Range": "bytes=1000-"})
    assert (status, body) == (206, whole[1000:])
    assert headers["Content-Range"] == f"bytes 1000-{len(whole) - 1}/{len(whole)}"
    status, _, body = _request(url, "GET", "/blob", {"Range": "bytes=-10"})
    assert (status, body) == (206, whole[-10:])
    assert _request(url, "GET", "/blob", {"Range": "bytes=5000-"})[0] == 416
    assert _request(url, "GET", "/missing")[0] == 404
    assert _request(url, "GET", "/../etc/passwd")[0] in (400, 404)


def test_put_needs_the_token_and_lands_atomically(served: tuple[str, Path]) -> None:
    url, root = served
    assert _request(url, "PUT", "/m/1/x", body=b"data")[0] == 401
    assert _request(url, "PUT", "/m/1/x", {"Authorization": "Bearer wrong"}, b"data")[0] == 403
    assert not (root / "m").exists()
    status, _, _ = _request(url, "PUT", "/m/1/x", {"Authorization": f"Bearer {TOKEN}"}, b"data")
    assert status == 201
    assert (root / "m/1/x").read_bytes() == b"data"
    assert not [p for p in (root / "m/1").iterdir() if p.name.startswith(".tmp")]


def test_a_device_pulls_a_published_version_over_it(
    served: tuple[str, Path], tmp_path: Path, upstream_key: Any, new_model: Any,
    subprocess_env: dict[str, str],
) -> None:
    from tests.support.registry_fixtures import Publisher

    url, root = served
    Publisher(root, tmp_path / "ck", upstream_key).publish(new_model(), "1")
    state = tmp_path / "state"
    run = subprocess.run(
        [sys.executable, "-m", "agent.cli", "pull", "digits@1", "--registry", url,
         "--state-dir", str(state), "--trusted-keys", str(upstream_key.trusted_dir),
         "--no-progress"],
        env=subprocess_env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    models = subprocess.run(
        [sys.executable, "-m", "agent.cli", "models", "--state-dir", str(state)],
        env=subprocess_env, capture_output=True, text=True, timeout=60,
    )
    assert models.returncode == 0, models.stderr
    assert "digits: active 1 (slot a, sequence 1, verified by upstream" in models.stdout
