"""A provisioned device for tests that run the real device job: a signed upstream model in a
registry folder, the device's data, and a state dir with that model pulled and active.

Cheap on purpose: the registry fixtures' test MLP (8x8 digits, ~300 KB), one noise-distorted
device set made by ``scripts/make_device_data.py``, one real ``agentctl pull``. Build it once
per session with :func:`provision_template` and give each test a copy with :func:`copy_device`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.registry_fixtures import KeyPair, Publisher, _build_test_model

REPO = Path(__file__).resolve().parents[2]
MODEL, VERSION = "digits", "1"


@dataclass(frozen=True)
class ProvisionedDevice:
    registry: Path
    """Registry folder holding digits@1, signed with the upstream key."""
    data: Path
    """The device's data (.npz)."""
    state: Path
    """A state dir: trusted keys (upstream + this device's), device key pair, digits@1 active."""

    def agent_config(self) -> dict[str, Any]:
        """What this device's agent.yaml says: its state, where its data sets live and the
        registry it pulls from (a command names none of these)."""
        return {"state_dir": str(self.state), "data_root": str(self.data.parent),
                "registry": {"url": str(self.registry)}}

    def finetune_args(self, **finetune: Any) -> dict[str, Any]:
        """A tiny finetune job (no export, a fixed micro-batch so no memory probes); the data
        set by name, under the agent's data_root."""
        ft = {"profile": "generic-x86", "sensors": "none", "steps": 2,
              "effective_batch": 16, "micro_batch": 16, **finetune}
        return {"model": MODEL, "data": self.data.name, "finetune": ft,
                "steps": {"export": False}}


def publish_upstream(registry: Path, work: Path, key: KeyPair) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    Publisher(registry, work, key).publish(_build_test_model(0), VERSION)
    return registry


def make_data(out: Path, env: dict[str, str]) -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts/make_device_data.py"), "--distortion",
                    "noise", "--out", str(out)], check=True, env=env, capture_output=True)
    return out


def provision_states(
    states: list[Path], registry: Path, key: KeyPair, env: dict[str, str]
) -> list[Path]:
    """For each state dir: the upstream's trusted keys, a device key pair of its own, and
    ``agentctl pull digits@1`` (the pulls run side by side)."""
    from registry.signing import generate_keypair

    pulls = []
    for state in states:
        trusted = state / "trusted_keys"
        trusted.mkdir(parents=True)
        for pub in key.trusted_dir.iterdir():
            (trusted / pub.name).write_bytes(pub.read_bytes())
        _, pub = generate_keypair(state, "device")
        (trusted / pub.name).write_bytes(pub.read_bytes())
        pulls.append(subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "pull", f"{MODEL}@{VERSION}", "--registry",
             str(registry), "--state-dir", str(state), "--no-progress"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in pulls:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode(errors="replace")
    return states


def provision_template(root: Path, key: KeyPair, env: dict[str, str]) -> ProvisionedDevice:
    registry = publish_upstream(root / "registry", root / "ck", key)
    data = make_data(root / "device.npz", env)
    (state,) = provision_states([root / "state"], registry, key, env)
    return ProvisionedDevice(registry, data, state)


def copy_device(template: ProvisionedDevice, dest: Path) -> ProvisionedDevice:
    """A fresh state dir (same model, keys and data) for one test."""
    shutil.copytree(template.state, dest, symlinks=True)  # the A/B slot link stays a link
    return ProvisionedDevice(template.registry, template.data, dest)
