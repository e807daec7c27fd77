"""``agentctl serve`` as a user runs it: a process on a Unix socket, answering the protocol,
following a commit, logging JSON, stopping cleanly on SIGTERM; a non-loopback host refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from registry.credentials import is_loopback
from tests.agent.runtime.conftest import Device
from tests.agent.runtime.test_oip import UnixHTTPConnection, call, infer_body


def test_agentctl_serve_on_a_unix_socket_follows_a_commit_and_stops_on_sigterm(
        device: Device, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    device.install(1)
    sock = tmp_path / "oip.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "serve", "--state-dir", str(device.state),
         "--model", "digits", "--unix-socket", str(sock), "--slo-ms", "20", "--threads", "1",
         "--spool-data-root", str(tmp_path / "data"), "--spool-quota-mb", "8",
         "--log-format", "json"], env=subprocess_env, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 30
        while not sock.is_socket():
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()[1]
            time.sleep(0.05)
        c = UnixHTTPConnection(sock)
        assert call(c, "GET", "/v2/health/ready") == (200, {"ready": True})
        status, out = call(c, "POST", "/v2/models/digits/infer", infer_body())
        assert status == 200 and out["model_version"] == "1"
        # Samples the application labels go to the spool a `data: spool` fine-tune reads.
        for label in (3, 7):
            status, out = call(c, "POST", "/v2/models/digits/record", _record_body(label))
            assert status == 200 and out["stored"] == 2, out
        device.install(2)
        end = time.monotonic() + 10
        while call(c, "POST", "/v2/models/digits/infer", infer_body())[1]["model_version"] != "2":
            assert time.monotonic() < end, "the commit was not followed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    serving = next(e for e in events if e.get("event") == "serving")
    assert serving["version"] == "1" and serving["address"] == f"unix:{sock}"
    assert any(e.get("event") == "swap" and e.get("version") == "2" for e in events)
    assert not sock.exists()  # removed on the way out
    from agent.spool.config import SpoolConfig
    from agent.spool.store import Spool

    kept = Spool(tmp_path / "data" / "spool" / "digits", SpoolConfig(quota_mb=8)).stats()
    assert kept.samples == 4 and kept.per_class == {3: 2, 7: 2} and kept.pseudo_labelled == 0


def _record_body(label: int) -> bytes:
    body = json.loads(infer_body([2, 1, 8, 8]))
    body["parameters"] = {"label": label}
    return json.dumps(body).encode()


def test_a_non_loopback_host_needs_allow_remote(device: Device,
                                                subprocess_env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "agent.cli", "serve", "--state-dir",
                        str(device.state), "--model", "digits", "--host", "0.0.0.0"],
                       env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a loopback address" in r.stderr
    assert "--allow-remote" in r.stderr


@pytest.mark.parametrize(("host", "ok"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("192.168.1.10", False), ("::", False), ("example.com", False),
])
def test_what_counts_as_loopback(host: str, ok: bool) -> None:
    assert is_loopback(host) is ok


def test_serve_help_has_examples() -> None:
    from agent.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = sub.format_help()
    assert "curl --unix-socket" in text and "tritonclient" in text
