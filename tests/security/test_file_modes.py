"""What the commands create is their user's alone, whatever umask they start with: the real
console scripts run under ``umask 000`` in a child process, then every path they made is
walked. Folders 0700, files 0600; on purpose readable by others (registry.atomic says why):
public keys and scopes (0644) and a folder registry's own tree (0755/0644). The daemon's
state dir is walked in test_daemon_files.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from registry.signing import generate_keypair
from tests.agent.daemon.conftest import device_template  # noqa: F401 (fixture)
from tests.security.conftest import SecureBroker
from tests.support.device import MODEL, ProvisionedDevice
from tests.support.registry_fixtures import (  # noqa: F401 (fixture)
    TEST_MODEL,
    _build_test_model,
    _save_model_checkpoint,
    upstream_key,
)

BIN = Path(sys.executable).parent


def run_unmasked(argv: list[str], env: dict[str, str], **kw: object
                 ) -> subprocess.CompletedProcess[str]:
    """``argv`` in a child whose umask is 000 (the most a shell or a service manager could
    leave it)."""
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: os.umask(0), check=False, **kw)  # type: ignore[call-overload]


def modes(root: Path) -> dict[str, int]:
    """Every path under ``root`` (itself included, links left out) -> its permission bits."""
    out = {".": stat.S_IMODE(root.lstat().st_mode)}
    for p in root.rglob("*"):
        st = p.lstat()
        if not stat.S_ISLNK(st.st_mode):
            out[str(p.relative_to(root))] = stat.S_IMODE(st.st_mode)
    return out


def loose(found: dict[str, int], public: Callable[[str], bool] = lambda rel: False,
          root: Path | None = None) -> list[tuple[str, str]]:
    """The paths whose mode is not 0700 (folder) / 0600 (file), or 0755 / 0644 where
    ``public(rel)``; each with its mode, for the failure message."""
    bad = []
    for rel, mode in found.items():
        is_dir = (root / rel).is_dir() if root is not None else False
        want = ((0o755 if is_dir else 0o644) if public(rel)
                else (0o700 if is_dir else 0o600))
        if mode != want:
            bad.append((rel, oct(mode)))
    return bad


def test_keygen_makes_a_private_folder_and_public_keys(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    out = tmp_path / "made" / "keys"
    r = run_unmasked([str(BIN / "hpc-train"), "keygen", "--out", str(out), "--name", "jetson-07",
                      "--scope", "digits@*+jetson-07.*"], subprocess_env)
    assert r.returncode == 0, r.stderr
    root = tmp_path / "made"
    found = modes(root)
    assert set(found) == {".", "keys", "keys/jetson-07.key.pem", "keys/jetson-07.pub.pem",
                          "keys/jetson-07.scope"}
    assert not loose(found, lambda rel: rel.endswith((".pub.pem", ".scope")), root)


def test_agentctl_pull_makes_a_private_state_dir(
    device_template: ProvisionedDevice, tmp_path: Path,  # noqa: F811
    subprocess_env: dict[str, str],
) -> None:
    """A state dir first made by ``agentctl`` from a login shell, before any daemon."""
    root = tmp_path / "new"
    r = run_unmasked([str(BIN / "agentctl"), "pull", f"{MODEL}@1", "--registry",
                      str(device_template.registry), "--state-dir", str(root / "state"),
                      "--trusted-keys", str(device_template.state / "trusted_keys")],
                     subprocess_env)
    assert r.returncode == 0, r.stdout + r.stderr
    found = modes(root)
    assert any(rel.startswith("state/models") for rel in found), sorted(found)
    assert not loose(found, root=root)


def test_edge_agent_validate_creates_nothing(
    device_template: ProvisionedDevice, tmp_path: Path,  # noqa: F811
    subprocess_env: dict[str, str],
) -> None:
    cfg = tmp_path / "agent.yaml"
    state = tmp_path / "state"
    cfg.write_text(yaml.safe_dump({"device_id": "dev-a", **device_template.agent_config(),
                                   "state_dir": str(state)}))
    r = run_unmasked([str(BIN / "edge-agent"), "validate", str(cfg)], subprocess_env)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.yaml"]


def test_a_folder_registry_publish_is_readable_and_nothing_else_is(
    tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    """``hpc-train publish`` into a new folder registry: the registry's tree is 0755/0644 (what
    a static server of another account serves), the folder above it that the publish made is
    0700."""
    key, _ = generate_keypair(tmp_path / "keys", "upstream")
    ckpt = _save_model_checkpoint(tmp_path / "ckpt", _build_test_model(0), dict(TEST_MODEL))
    root = tmp_path / "new"
    r = run_unmasked([str(BIN / "hpc-train"), "publish", str(ckpt), "--registry",
                      str(root / "registry"), "--name", "digits", "--version", "1",
                      "--sign-key", str(key)], subprocess_env)
    assert r.returncode == 0, r.stdout + r.stderr
    found = modes(root)
    assert "registry/digits/1/manifest.json" in found, sorted(found)
    assert not loose(found, lambda rel: rel.startswith("registry"), root)


def test_fleetctl_writes_its_state_and_the_brokers_files_private(
    secure_broker: Callable[..., SecureBroker], tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    """``broker-config`` (secrets, passwords, ACLs) and a controller's db, lock and reports,
    each from a login shell's worst umask."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"devices": {"dev-a": {"groups": ["lab"]}}}))
    root = tmp_path / "new"
    fleetctl = [str(BIN / "fleetctl")]
    r = run_unmasked([*fleetctl, "broker-config", "--inventory", str(inv), "--out",
                      str(root / "broker"), "--secrets", str(root / "secrets")], subprocess_env)
    assert r.returncode == 0, r.stderr
    sb = secure_broker()
    argv = sb.fleetctl_argv("fleet-controller", root / "fleet")
    argv[:3] = fleetctl  # the console script, not python -m
    r = run_unmasked([*argv, "controller"], subprocess_env)
    assert r.returncode == 0, r.stdout + r.stderr
    found = modes(root)
    assert {"secrets/operators/fleet-send.password", "broker/passwd-devices",
            "fleet/fleet.db", "fleet/fleet.db.lock"} <= set(found), sorted(found)
    assert not loose(found, root=root)
