"""The device's trust comes from its own config, never from a command: attacks on a real
``edge-agent`` logged in to the mosquitto that ``fleetctl broker-config`` provisions, sent from
the operator account (``fleet-send``) as a compromised or careless operator would.

Each test shows the attack refused *and* nothing lost: the active model unchanged and still
verifying against the device's trusted keys, and an honest job queued after the attack runs.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.jobs.store import JobStore
from contract import TERMINAL_STATUSES, Topics
from registry.signing import generate_keypair, load_signing_key
from tests.agent.daemon.conftest import (  # noqa: F401 (fixtures)
    AgentProc,
    agent,
    assert_active_verified,
    command,
    device,
    device_template,
    secret_file,
)
from tests.security.conftest import SecureBroker
from tests.support.device import MODEL, ProvisionedDevice
from tests.support.mqtt import Peer
from tests.support.registry_fixtures import (  # noqa: F401 (fixture)
    KeyPair,
    Publisher,
    _build_test_model,
    upstream_key,
)

T = Topics()


def _on_secure_broker(sb: SecureBroker, dev: ProvisionedDevice, tmp_path: Path,
                      **cfg: Any) -> dict[str, Any]:
    """agent.yaml for dev-a on the provisioned broker: its own password, its own registry copy
    (this test publishes into it), its data root."""
    registry = tmp_path / "device-registry"
    if not registry.exists():
        shutil.copytree(dev.registry, registry)
    pw = secret_file(tmp_path / "dev-a.password", sb.password("devices", "dev-a"))
    out = {**dev.agent_config(), "registry": {"url": str(registry)},
           "mqtt": {"password_file": str(pw)}}
    out.update(cfg)
    return out


def _results(op: Peer, cid: str) -> list[dict[str, Any]]:
    return [m.json() for m in op.matching(
        lambda m: m.topic == T.result("dev-a") and m.json().get("id") == cid)]


def _send(op: Peer, type_: str, timeout_s: float = 20, **body: Any) -> dict[str, Any]:
    """Publish a command as the operator; its terminal result."""
    cmd = command(type_, **body)
    assert not op.publish(T.command("dev-a", type_), cmd).is_failure
    got = op.wait_for(lambda m: m.topic == T.result("dev-a") and m.json().get("id") == cmd["id"]
                      and m.json()["status"] in TERMINAL_STATUSES, timeout_s=timeout_s)
    return dict(got[-1].json())


def _online(op: Peer) -> None:
    op.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online",
                timeout_s=20)


def _attacker(tmp_path: Path, dev: ProvisionedDevice) -> dict[str, Path]:
    """What the attacker controls: a key pair, a folder trusting it, and a registry holding
    digits@666 signed by it at sequence 1,000,000 (every real version would then look like
    a downgrade)."""
    root = tmp_path / "attacker"
    priv, pub = generate_keypair(root / "keys", "upstream")  # even named like the real one
    trusted = root / "trusted"
    trusted.mkdir()
    shutil.copy(pub, trusted / pub.name)
    reg = root / "registry"
    (reg / MODEL).mkdir(parents=True)
    (reg / MODEL / "_sequence.json").write_text(json.dumps({"sequence": 999_999}))
    key = KeyPair(load_signing_key(priv), priv, pub, trusted)
    report = Publisher(reg, root / "ck", key).publish(_build_test_model(7), "666")
    assert report.manifest.sequence == 1_000_000
    return {"key": priv, "trusted": trusted, "registry": reg}


def test_a_command_cannot_choose_its_own_trust_root(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, upstream_key: KeyPair, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    cfg = _on_secure_broker(sb, device, tmp_path)
    op = sb.operator("fleet-send").subscribe(T.result("dev-a"), T.status("dev-a"))
    a = agent(sb.devices, **cfg)
    _online(op)
    evil = _attacker(tmp_path, device)
    one_line_pem = "".join(evil["trusted"].joinpath("upstream.pub.pem").read_text().split())
    attacks = [
        ("deploy", {"model": MODEL, "version": "666", "registry": str(evil["registry"]),
                    "trusted_keys": str(evil["trusted"])}, "args.registry"),
        ("deploy", {"model": MODEL, "version": "666", "trusted_keys": str(evil["trusted"])},
         "args.trusted_keys"),
        # A PEM riding in the registry URL's query string, then the job database read back
        # as the "key file".
        ("deploy", {"model": MODEL, "version": "666",
                    "registry": f"file://{evil['registry']}?k={one_line_pem}",
                    "trusted_keys": str(device.state / "jobs.db")}, "args.registry"),
        ("finetune", {**device.finetune_args(), "signing_key": str(evil["key"]),
                      "upload": {"registry": str(evil["registry"])}, "steps": {"upload": True}},
         "args.signing_key"),
        ("finetune", {**device.finetune_args(), "upload": {"registry": str(evil["registry"])}},
         "args.upload.registry"),
        ("finetune", {**device.finetune_args(), "registry": str(evil["registry"]),
                      "version": "666"}, "args.registry"),
        ("rollback", {"name": MODEL, "trusted_keys": str(evil["trusted"])},
         "args.trusted_keys"),
        # Paths where the device expects a name.
        ("finetune", {**device.finetune_args(), "data": str(device.data)}, "args.data"),
        ("finetune", {**device.finetune_args(), "data": "../device-state/jobs.db"},
         "args.data"),
        ("finetune", {**device.finetune_args(profile="/tmp/evil")}, "args.finetune.profile"),
        ("finetune", {**device.finetune_args(), "export": {"tensorrt": {
            "timing_cache": str(device.state / "jobs.db")}}},
         "args.export.tensorrt.timing_cache"),
        ("deploy", {"model": MODEL, "version": "1", "data": "/etc"}, "args.data"),
    ]
    try:
        for type_, args, field in attacks:
            res = _send(op, type_, args=args)
            assert res["status"] == "REJECTED", (args, res)
            assert res["error"]["code"] == "BAD_ARGS" and field in res["error"]["message"], res
        # Nothing of the attacker's reached the device: digits@1 active and verified with the
        # device's own keys, no job beyond the refusals, no version 666 anywhere.
        assert_active_verified(device.state, "1")
        jobs = JobStore(device.state).list(limit=100)
        assert {j.state.value for j in jobs} == {"REJECTED"} and len(jobs) == len(attacks)
        assert not list((device.state / "models").rglob("*666*"))

        # The honest path: upstream publishes digits@2 (sequence 2) to the device's own
        # registry and deploys it. Not refused as a downgrade: no 1,000,000 was ever trusted.
        Publisher(Path(cfg["registry"]["url"]), tmp_path / "up-ck", upstream_key).publish(
            _build_test_model(1), "2", parent="1")
        res = _send(op, "deploy", args={"model": MODEL, "version": "2"}, timeout_s=180)
        assert res["status"] == "SUCCEEDED", res
        assert res["result"]["outcome"] == "committed", res
        m = assert_active_verified(device.state, "2")
        assert m.sequence == 2
    finally:
        op.close()
    assert a.stop() == 0


@pytest.mark.parametrize("bad_id", ["..", "-x", ".hidden", "a/b", "x" * 129, "a b", "a\nb",
                                    "--job-id=other"])
def test_unsafe_command_ids_are_refused_unstored(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path, bad_id: str,  # noqa: F811
) -> None:
    sb = secure_broker()
    op = sb.operator("fleet-send").subscribe(T.result("dev-a"), T.status("dev-a"))
    a = agent(sb.devices, **_on_secure_broker(sb, device, tmp_path))
    _online(op)
    before = sorted(p.name for p in device.state.iterdir())
    try:
        cmd = command("finetune", args=device.finetune_args(), id=bad_id)
        assert not op.publish(T.command("dev-a", "finetune"), cmd).is_failure
        # No usable id: answered with "" (the sender matches it by CorrelationData) and
        # nothing is stored under it, no folder made from it, no worker started with it.
        got = op.wait_for(lambda m: m.topic == T.result("dev-a") and m.json()["id"] == "")
        res = got[-1].json()
        assert res["status"] == "REJECTED" and res["error"]["code"] == "BAD_ENVELOPE", res
        assert JobStore(device.state).list(limit=10) == []
        assert sorted(p.name for p in device.state.iterdir()) == before
        assert_active_verified(device.state, "1")
    finally:
        op.close()
    assert a.stop() == 0


def test_an_id_with_every_allowed_character_runs_as_one_argument(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    op = sb.operator("fleet-send").subscribe(T.result("dev-a"), T.status("dev-a"))
    a = agent(sb.devices, **_on_secure_broker(sb, device, tmp_path))
    _online(op)
    try:
        jid = "9ft:2026-11-23T05.30_a-b"
        res = _send(op, "finetune", args=device.finetune_args(), id=jid, timeout_s=180)
        assert res["status"] == "SUCCEEDED" and res["result"]["outcome"] == "committed", res
        assert (device.state / "jobs" / jid).is_dir()
        assert "worker done" in (device.state / "logs" / f"{jid}.log").read_text()
        assert_active_verified(device.state, res["result"]["model"]["version"])
    finally:
        op.close()
    assert a.stop() == 0


# --- the trusted-keys folder ---------------------------------------------------------------


def _spoil(trusted: Path, how: str, tmp_path: Path) -> Path:
    """Make the trusted-keys folder untrustworthy one way; the path a refusal must name."""
    evil_priv, evil_pub = generate_keypair(tmp_path / "evil-keys", "evil")
    pem = evil_pub.read_bytes()
    if how == "group-writable key":
        f = trusted / "evil.pub.pem"
        f.write_bytes(pem)
        f.chmod(0o664)
        return f
    if how == "world-writable folder":
        trusted.chmod(0o777)
        return trusted
    if how == "two keys in one file":
        f = trusted / "extra.pub.pem"
        f.write_bytes(pem + (trusted / "upstream.pub.pem").read_bytes())
        return f
    if how == "key after other text":
        f = trusted / "noise.pub.pem"
        f.write_bytes(b"jobs.db?registry=x&k=\n" + pem)
        return f
    if how == "symlink":
        f = trusted / "link.pub.pem"
        f.symlink_to(evil_pub)
        return f
    if how == "stray file":
        f = trusted / "evil.key.pem"
        f.write_bytes(evil_priv.read_bytes())
        return f
    if how == "someone else's key":
        f = trusted / "evil.pub.pem"
        f.write_bytes(pem)
        os.chown(f, 4242, 4242)
        return f
    raise AssertionError(how)


SPOILS = ["group-writable key", "world-writable folder", "two keys in one file",
          "key after other text", "symlink", "stray file", "someone else's key"]


@pytest.mark.parametrize("how", SPOILS)
def test_an_untrustworthy_trusted_keys_folder_is_refused_at_start(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path, how: str,  # noqa: F811
) -> None:
    if how == "someone else's key" and os.geteuid() != 0:
        pytest.skip("chown needs root")
    sb = secure_broker()
    blamed = _spoil(device.state / "trusted_keys", how, tmp_path)
    a = agent(sb.devices, wait_ready=False, **_on_secure_broker(sb, device, tmp_path))
    assert a.proc is not None and a.proc.wait(30) == 2
    assert str(blamed) in a.log_text() and "registry.trusted_keys" in a.log_text(), (
        a.log_text()[-2000:])
    # Refused before anything was opened: the state is as provisioning left it.
    assert not (device.state / "jobs.db").exists()


def test_a_folder_spoiled_while_running_fails_the_job_and_changes_nothing(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, upstream_key: KeyPair, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    cfg = _on_secure_broker(sb, device, tmp_path)
    op = sb.operator("fleet-send").subscribe(T.result("dev-a"), T.status("dev-a"))
    a = agent(sb.devices, **cfg)
    _online(op)
    trusted = device.state / "trusted_keys"
    try:
        Publisher(Path(cfg["registry"]["url"]), tmp_path / "up-ck", upstream_key).publish(
            _build_test_model(1), "2", parent="1")
        blamed = _spoil(trusted, "key after other text", tmp_path)
        res = _send(op, "deploy", args={"model": MODEL, "version": "2"}, timeout_s=120)
        assert res["status"] == "FAILED" and str(blamed) in res["error"]["message"], res
        blamed.unlink()
        # Verified against the repaired folder: the failed job touched nothing.
        assert_active_verified(device.state, "1")
        time.sleep(0.2)
        res = _send(op, "deploy", args={"model": MODEL, "version": "2"}, timeout_s=180)
        assert res["status"] == "SUCCEEDED", res
        assert_active_verified(device.state, "2")
    finally:
        op.close()
    assert a.stop() == 0
