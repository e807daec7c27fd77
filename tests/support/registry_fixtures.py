"""Registry fixtures: the loopback server, key pairs, a publisher of test models.

Imported by the conftest of every test package that talks to a registry (tests/registry,
tests/agent), so they share one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from registry.signing import SigningKey, generate_keypair, load_signing_key
from tests.support.registry_server import RegistryServer

# The model most device tests use: an MLP on 8x8 digits, 18 tensors (~300 KB). With 16 KiB
# chunks and 4 KiB packing, each hidden weight is 4 chunks of its own and the biases share one.
TEST_MODEL = {"name": "mlp", "kwargs": {"hidden": [128] * 8}, "num_classes": 10,
              "in_channels": 1, "image_size": 8}
TEST_CHUNK = 16 << 10
TEST_PACK = 4 << 10


@pytest.fixture
def registry_server(tmp_path: Path) -> Iterator[RegistryServer]:
    root = tmp_path / "registry"
    root.mkdir()
    with RegistryServer(root) as server:
        yield server


@dataclass(frozen=True)
class KeyPair:
    signing: SigningKey
    private_path: Path
    public_path: Path
    trusted_dir: Path
    """A folder holding only this key's public half."""


def _make_keypair(where: Path, name: str) -> KeyPair:
    priv, pub = generate_keypair(where / name, name)
    trusted = where / f"{name}-trusted"
    trusted.mkdir()
    (trusted / pub.name).write_bytes(pub.read_bytes())
    return KeyPair(load_signing_key(priv), priv, pub, trusted)


@pytest.fixture(scope="session")
def upstream_key(tmp_path_factory: pytest.TempPathFactory) -> KeyPair:
    return _make_keypair(tmp_path_factory.mktemp("keys"), "upstream")


@pytest.fixture
def make_keypair(tmp_path: Path) -> Callable[[str], KeyPair]:
    """make_keypair(name): a fresh key pair and a trusted-keys folder holding its public half."""
    return lambda name: _make_keypair(tmp_path, name)


def _save_model_checkpoint(dest: Path, model: Any, spec: dict[str, Any] | None = None,
                           step: int = 1) -> Path:
    from hpc_core.checkpoint import save_checkpoint
    from hpc_core.config import config_from_dict

    cfg = config_from_dict({"model": spec or TEST_MODEL, "training": {"max_steps": step}})
    return save_checkpoint(dest, model_state=model.state_dict(),
                           trainer_state={"step": step, "epoch": 0, "config": cfg.to_dict(),
                                          "metrics": {"eval/acc": 0.5}})


def _build_test_model(seed: int = 0) -> Any:
    import torch

    from hpc_core.models import build_model

    torch.manual_seed(seed)
    return build_model(TEST_MODEL["name"], num_classes=TEST_MODEL["num_classes"],
                       in_channels=TEST_MODEL["in_channels"], image_size=TEST_MODEL["image_size"],
                       **TEST_MODEL["kwargs"])


@pytest.fixture(scope="session")
def new_model() -> Callable[..., Any]:
    """new_model(seed=0): the test MLP with seeded weights."""
    return _build_test_model


@dataclass
class Publisher:
    """Publishes models into the server's registry folder with the upstream key."""

    root: Path
    work: Path
    key: KeyPair
    spec: dict[str, Any] = field(default_factory=lambda: dict(TEST_MODEL))
    chunk_size: int = TEST_CHUNK
    pack_below: int = TEST_PACK

    def checkpoint(self, model: Any, label: str) -> Path:
        return _save_model_checkpoint(self.work / label, model, self.spec)

    def publish(self, model: Any, version: str, *, parent: str | None = None,
                artefacts: tuple[Path, ...] = (), key: SigningKey | None = None,
                store: Any = None, base: str | None = None) -> Any:
        """``base``: the upstream release a device version names as its lineage's start
        (what a device's upload names), taken with its sequence from the store."""
        from hpc_core.model_spec import read_checkpoint
        from registry.manifest import BaseRelease
        from registry.publish import (
            collect_artefacts,
            parent_sequence,
            publish_content,
            publish_version,
        )
        from registry.stores import LocalStore

        content = read_checkpoint(self.checkpoint(model, f"v{version}"))
        store = store or LocalStore(self.root)
        if base is None:
            return publish_content(content, store, name="digits", version=version,
                                   key=key or self.key.signing, parent=parent,
                                   artefacts=artefacts, chunk_size=self.chunk_size,
                                   pack_below=self.pack_below)
        return publish_version(
            store, name="digits", version=version, parent=parent,
            parent_seq=parent_sequence(store, "digits", parent) if parent else 0,
            base=BaseRelease(version=base, sequence=parent_sequence(store, "digits", base)),
            model=content.model, training=content.training, tensors=content.tensors,
            artefacts=collect_artefacts(artefacts), key=key or self.key.signing,
            chunk_size=self.chunk_size, pack_below=self.pack_below)


@pytest.fixture
def publisher(registry_server: RegistryServer, tmp_path: Path, upstream_key: KeyPair) -> Publisher:
    work = tmp_path / "checkpoints"
    work.mkdir()
    return Publisher(registry_server.root, work, upstream_key)


@pytest.fixture
def fast_transfers() -> Any:
    """Transfer settings with test-sized back-off and timeouts."""
    from registry.transfer import TransferConfig

    return TransferConfig(connect_timeout_s=2, read_timeout_s=2, retries=6, backoff_base_s=0.01,
                          backoff_max_s=0.05, free_disk_margin_bytes=0)
