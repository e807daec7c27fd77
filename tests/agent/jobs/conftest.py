"""A device for the job tests: an upstream small_cnn (GroupNorm) trained once on clean digits,
published signed to a registry served over loopback HTTP, device data with the documented
distortion (scripts/make_device_data.py: inverted + noisy), and device keys."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.support.built_once import built_once
from tests.support.registry_server import RegistryServer

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Device:
    root: Path
    registry: RegistryServer
    data: Path
    upstream: Path

    @property
    def state(self) -> Path:
        return self.root / "state"

    model: ClassVar[str] = "digits"
    """The model the device's upstream is published as (``NAME@v1``)."""

    def base_spec(self) -> dict[str, Any]:
        """The job the tests run: 60 steps, micro-batch given (no probes)."""
        return {
            "model": self.model, "version": "v1", "registry": self.registry.url,
            "data": str(self.data),
            "finetune": {"profile": "generic-x86", "sensors": "none", "trainable": "all",
                         "steps": 60, "effective_batch": 64, "micro_batch": 64, "lr": 0.01,
                         "checkpoint_every": 10},
            "export": {"gates": {"latency_iters": 10, "eval_samples": 200},
                       "calibration": {"samples": 128},
                       "fallback": {"sensitivity_samples": 64}},
        }

    def spec(self, **over: Any) -> dict[str, Any]:
        """:meth:`base_spec` with ``over``'s sections merged in (a dict section key by key)."""
        spec = self.base_spec()
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(spec.get(k), dict):
                spec[k] = {**spec[k], **v}
            else:
                spec[k] = v
        return spec

    def install(self) -> None:
        """agentctl pull MODEL@v1: the upstream becomes the active model."""
        from agent.storage.update import update
        from registry.refs import parse_ref
        from registry.signing import load_trusted_keys

        update(parse_ref(f"{self.model}@v1", self.registry.url), state_dir=self.state,
               trusted=load_trusted_keys(self.state / "trusted_keys"))


SMALL_CNN = ["training.epochs=4", "model.kwargs={width: 8, norm: group}"]
"""The tests' upstream: small_cnn (GroupNorm, width 8) at the config's 16 px."""


def build_template(root: Path, upstream: list[str] | None = None, image_size: int = 16
                   ) -> Path:
    """Upstream model (``root/up``, trained with ``upstream`` overrides of
    configs/digits.yaml), device data at ``image_size``, upstream and device keys under
    ``root``; also used by benchmarks/device_job.py and benchmarks/job_budget.py."""
    overrides = [f"run.output_dir={root / 'up'}", "logging.progress=off",
                 "checkpoint.best_metric=null", f"data.image_size={image_size}",
                 *(SMALL_CNN if upstream is None else upstream)]
    code = f"""
import sys
sys.path.insert(0, {str(REPO / 'scripts')!r})
from pathlib import Path
from hpc_core.config import load_config
from hpc_core.trainer import Trainer
from make_device_data import make_device_data
root = Path({str(root)!r})
cfg = load_config(Path({str(REPO / 'configs/digits.yaml')!r}), {overrides!r})
Trainer(cfg).train()
make_device_data(root / "device.npz", ["invert", "noise"], image_size={image_size})
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    return make_keys(root)


def make_keys(root: Path) -> Path:
    """The upstream's key pair under ``root/keys`` (its private key's path in
    ``root/upstream.key``), and a device state dir ``root/state`` with its own key pair and
    both public keys trusted."""
    from registry.signing import generate_keypair, load_signing_key

    up_priv, up_pub = generate_keypair(root / "keys", "upstream")
    state = root / "state"
    (state / "trusted_keys").mkdir(parents=True)
    _, dev_pub = generate_keypair(state, "device")
    for p in (up_pub, dev_pub):
        (state / "trusted_keys" / p.name).write_bytes(p.read_bytes())
    assert load_signing_key(up_priv) is not None
    (root / "upstream.key").write_text(str(up_priv))
    return root


def publish_v1(template: Path, reg: Path, name: str = "digits") -> None:
    """NAME@v1 (``template/up``), signed by the upstream key, into the registry folder
    ``reg``."""
    from hpc_core.model_spec import read_checkpoint
    from registry.publish import publish_content
    from registry.signing import load_signing_key
    from registry.stores import LocalStore

    key = load_signing_key(Path((template / "upstream.key").read_text()))
    publish_content(read_checkpoint(template / "up"), LocalStore(reg), name=name,
                    version="v1", key=key)


@pytest.fixture(scope="session")
def device_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once a run, whichever test process asks first (read only: a device copies its
    state, a test that publishes writes its own registry)."""
    return built_once(tmp_path_factory, "jobs-device-template", build_template)


@pytest.fixture(scope="session")
def registry(device_template: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[RegistryServer]:
    """One registry for the session, holding digits@v1 signed by the upstream key (the tests
    that upload add their own versions; none changes v1)."""
    reg = tmp_path_factory.mktemp("registry")
    publish_v1(device_template, reg)
    with RegistryServer(reg) as server:
        yield server


def make_device(template: Path, registry: RegistryServer, root: Path) -> Device:
    """A fresh device at ``root`` (keys only, nothing installed) on the shared registry."""
    shutil.copytree(template / "state", root / "state")
    return Device(root, registry, template / "device.npz", template / "up")


@pytest.fixture
def device(device_template: Path, registry: RegistryServer, tmp_path: Path) -> Device:
    return make_device(device_template, registry, tmp_path / "dev")
