"""Files: what the daemon creates is the service user's alone whatever umask it starts with,
secrets others could read are refused at start with the path named, and no working directory
can put a module in front of the agent's own in a job's processes."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from contract import TERMINAL_STATUSES, Topics
from registry.signing import generate_keypair
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
from tests.support.mosquitto import Broker
from tests.support.mqtt import Received
from tests.support.pki import make_pki
from tests.support.registry_fixtures import upstream_key  # noqa: F401 (fixture)

T = Topics()
BIN = Path(sys.executable).parent


def _res(cid: str, *statuses: str) -> Callable[[Received], bool]:
    return lambda m: (m.topic == T.result("dev-a") and m.json().get("id") == cid
                      and (not statuses or m.json()["status"] in statuses))


def _fresh_state(dev: ProvisionedDevice, root: Path) -> Path:
    """A new device: only its trusted keys (provisioning's, 0755/0644) and its key pair."""
    state = root / "state"
    shutil.copytree(dev.state / "trusted_keys", state / "trusted_keys")
    for f in ("device.key.pem", "device.pub.pem"):
        shutil.copy2(dev.state / f, state / f)
    return state


def test_state_is_private_whatever_the_umask(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    state = _fresh_state(device, tmp_path / "fresh")
    provisioned = {p for p in state.rglob("*")} | {state}
    pw = secret_file(tmp_path / "dev-a.password", sb.password("devices", "dev-a"))
    op = sb.operator("fleet-send").subscribe(T.result("dev-a"), T.status("dev-a"))
    old = os.umask(0)  # the daemon and everything it starts inherit it
    try:
        a = agent(sb.devices, state_dir=str(state), data_root=str(device.data.parent),
                  registry={"url": str(device.registry)}, mqtt={"password_file": str(pw)})
    finally:
        os.umask(old)
    try:
        op.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online",
                    timeout_s=20)
        # A deploy onto the empty device (pull, chunks, slots, job folder, worker log), a
        # finetune on top (its children, checkpoints, a staged version), a refusal, a ping.
        ends = []
        for type_, args in (("deploy", {"model": MODEL, "version": "1"}),
                            ("finetune", device.finetune_args()),
                            ("finetune", {"model": MODEL, "data": "nope"}), ("ping", {})):
            c = command(type_, args=args)
            op.publish(T.command("dev-a", type_), c)
            ends.append(op.wait_for(_res(c["id"], *TERMINAL_STATUSES),
                                    timeout_s=180)[-1].json())
        assert [e["status"] for e in ends] == ["SUCCEEDED", "SUCCEEDED", "REJECTED",
                                               "SUCCEEDED"], ends
        assert_active_verified(state, ends[1]["result"]["model"]["version"])
    finally:
        op.close()
    assert a.stop() == 0
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    loose = []
    for p in state.rglob("*"):
        if p in provisioned or p.is_symlink():
            continue  # what the test put there; `current` is a link (its mode means nothing)
        mode = stat.S_IMODE(p.lstat().st_mode)
        if mode & 0o077:
            loose.append((str(p.relative_to(state)), oct(mode)))
    assert not loose, loose
    assert {"jobs.db", "agent.db", "jobs", "logs", "models"} <= {p.name for p in state.iterdir()}


@pytest.mark.parametrize("which", ["mqtt.password_file", "mqtt.tls.key",
                                   "registry.signing_key", "registry.token_file",
                                   "default signing key"])
@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_a_secret_others_can_read_is_refused_at_start(
    agent: Callable[..., AgentProc], device: ProvisionedDevice,  # noqa: F811
    tmp_path: Path, which: str, mode: int,
) -> None:
    nowhere = Broker("127.0.0.1", 1, tmp_path / "none.conf", tmp_path)  # never reached
    cfg: dict[str, Any] = dict(device.agent_config())
    if which == "mqtt.password_file":
        secret = secret_file(tmp_path / "dev-a.password", "s3cret-s3cret-s3cret")
        cfg["mqtt"] = {"password_file": str(secret)}
    elif which == "mqtt.tls.key":
        pki = make_pki(tmp_path / "pki", ["dev-a"])
        cert, secret = pki.client("dev-a")
        cfg["mqtt"] = {"tls": {"ca": str(pki.ca_cert), "cert": str(cert), "key": str(secret)}}
    elif which == "registry.signing_key":
        secret, _ = generate_keypair(tmp_path / "keys", "dev-a")
        cfg["registry"] = {**cfg["registry"], "signing_key": str(secret)}
    elif which == "registry.token_file":
        secret = secret_file(tmp_path / "registry.token", "t" * 32)
        cfg["registry"] = {**cfg["registry"], "token_file": str(secret)}
    else:
        which, secret = "registry.signing_key", device.state / "device.key.pem"
    secret.chmod(mode)
    a = agent(nowhere, wait_ready=False, **cfg)
    assert a.proc is not None and a.proc.wait(30) == 2
    text = a.log_text()
    assert f"{which}: secret {secret} is open to group or others" in text, text[-2000:]
    # Refused before the state was touched: the device is as provisioning left it.
    assert not (device.state / "jobs.db").exists()
    assert_active_verified(device.state, "1")
    secret.chmod(0o600)  # the fix the message names: the same config now starts
    ok = AgentProc(tmp_path / "fixed", nowhere, "dev-a", a.env, **cfg).start()
    assert ok.stop() == 0


def test_edge_agent_validate_names_the_loose_secret(
    device: ProvisionedDevice, tmp_path: Path, subprocess_env: dict[str, str],  # noqa: F811
) -> None:
    secret = secret_file(tmp_path / "dev-a.password", "s3cret-s3cret-s3cret")
    secret.chmod(0o644)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"device_id": "dev-a", **device.agent_config(),
                                   "mqtt": {"password_file": str(secret)}}))
    r = subprocess.run([str(BIN / "edge-agent"), "validate", str(cfg)], capture_output=True,
                       text=True, env=subprocess_env, timeout=60)
    assert r.returncode == 2 and str(secret) in r.stderr, r.stderr


def test_the_working_directory_never_shadows_the_agent(
    secure_broker: Callable[..., SecureBroker], device: ProvisionedDevice,  # noqa: F811
    tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    """The daemon started from a folder holding an ``agent`` package of someone else's (an
    operator's home, /tmp): the job's worker and its children import the real agent."""
    sb = secure_broker()
    trap = tmp_path / "cwd"
    marker = tmp_path / "shadowed"
    for pkg in ("agent", "agent/jobs", "agent/jobs/steps", "agent/finetune"):
        (trap / pkg).mkdir(parents=True)
        (trap / pkg / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n")
    steps = ("pull", "finetune", "export", "stage", "health")  # each runs as its own child
    for mod in ("agent/jobs/worker.py", *(f"agent/jobs/steps/{s}.py" for s in steps)):
        (trap / mod).write_text(f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n")
    pw = secret_file(tmp_path / "dev-a.password", sb.password("devices", "dev-a"))
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "device_id": "dev-a", **device.agent_config(), "sensors": "none", "telemetry_s": 0,
        "socket_group": None, "mqtt": {"host": sb.devices.host, "port": sb.devices.port,
                                       "password_file": str(pw)}}))
    op = sb.operator("fleet-send").subscribe(T.result("dev-a"), T.status("dev-a"))
    # The console script, as systemd starts it: the daemon itself never imports from its cwd.
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(BIN / "edge-agent"), "--config", str(cfg)], cwd=trap,
                            env=subprocess_env, stdout=log, stderr=log)
    log.close()
    try:
        op.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online",
                    timeout_s=30)
        c = command("finetune", args=device.finetune_args())
        op.publish(T.command("dev-a", "finetune"), c)
        end = op.wait_for(_res(c["id"], *TERMINAL_STATUSES), timeout_s=180)[-1].json()
        assert end["status"] == "SUCCEEDED", (end, (tmp_path / "daemon.log").read_text()[-2000:])
        assert not marker.exists(), marker.read_text()
        assert_active_verified(device.state, end["result"]["model"]["version"])
    finally:
        op.close()
        proc.terminate()
        proc.wait(30)
