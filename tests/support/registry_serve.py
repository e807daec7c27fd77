"""The real ``python -m registry.serve`` on loopback, provisioned as an operator would: an
upstream publisher and devices, each with its own key pair (a device's scoped to its own
versions), token (minted by ``add-principal``) and principals entry; helpers to publish,
pull and upload through it as each of them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.credentials import RegistryCredential
from registry.manifest import Manifest
from registry.principals import add_principal
from registry.signing import SigningKey, generate_keypair, load_signing_key
from registry.stores import HttpStore
from registry.transfer import TransferConfig
from tests.support.registry_fixtures import TEST_CHUNK, TEST_PACK

REPO = Path(__file__).resolve().parents[2]
MODEL = "digits"


def fast() -> TransferConfig:
    return TransferConfig(connect_timeout_s=2, read_timeout_s=5, retries=4, backoff_base_s=0.01,
                          backoff_max_s=0.1, free_disk_margin_bytes=0, request_deadline_s=60)


@dataclass
class Principal:
    name: str
    key: SigningKey
    token: str


@dataclass
class ServedRegistry:
    root: Path
    url: str
    proc: subprocess.Popen[str]
    trusted: Path
    """The server's trusted keys, which also serve as a device's trusted-keys folder."""
    who: dict[str, Principal] = field(default_factory=dict)

    def credential(self, name: str) -> RegistryCredential:
        return RegistryCredential(registry=self.url, token=self.who[name].token)

    def store(self, name: str | None = None, cfg: TransferConfig | None = None) -> HttpStore:
        """The registry as ``name`` sees it (None: anonymous)."""
        cred = self.credential(name) if name else None
        return HttpStore(self.url, cfg or fast(), cred)

    def manifest(self, version: str) -> Manifest:
        return Manifest.from_bytes((self.root / MODEL / version / "manifest.json").read_bytes())

    def publish(self, content: Any, version: str, *, as_: str = "upstream",
                parent: str | None = None) -> Any:
        from registry.publish import publish_content

        return publish_content(content, self.store(as_), name=MODEL, version=version,
                               key=self.who[as_].key, parent=parent, chunk_size=TEST_CHUNK,
                               pack_below=TEST_PACK)

    def upload(self, content: Any, device: str, *, parent: str = "1",
               version: str | None = None, cfg: TransferConfig | None = None) -> Any:
        """What a device's upload step does: a child of the installed ``parent``."""
        from registry.upload import upload

        return upload(content, parent=self.manifest(parent), target=self.url,
                      key=self.who[device].key, version=version, cfg=cfg or fast(),
                      credential=self.credential(device))

    def snapshot(self) -> dict[str, bytes]:
        """Every object of the registry, by key: what an attack must leave unchanged."""
        return {p.relative_to(self.root).as_posix(): p.read_bytes()
                for p in sorted(self.root.rglob("*"))
                if p.is_file() and not p.relative_to(self.root).as_posix().startswith(".")}

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM")


def make_contents(where: Path, n: int) -> list[Any]:
    """``n`` checkpoints of the test model (seeds 0..n-1) read as publishable content."""
    from hpc_core.model_spec import read_checkpoint
    from tests.support.registry_fixtures import _build_test_model, _save_model_checkpoint

    return [read_checkpoint(_save_model_checkpoint(where / f"seed{i}", _build_test_model(i)))
            for i in range(n)]


def provision(where: Path, devices: list[str]) -> tuple[Path, Path, dict[str, Principal]]:
    """Keys, tokens and the principals file for upstream and ``devices``, through the same
    calls ``hpc-train keygen`` and ``registry.serve add-principal`` make."""
    trusted, keys, tokens = where / "trusted", where / "keys", where / "tokens"
    trusted.mkdir(parents=True)
    principals = where / "principals.yaml"
    who: dict[str, Principal] = {}
    for name in ["upstream", *devices]:
        scope = [] if name == "upstream" else [f"{MODEL}@*+{name}.*"]
        priv, pub = generate_keypair(keys, name, scope)
        (trusted / pub.name).write_bytes(pub.read_bytes())
        if scope:
            (trusted / f"{name}.scope").write_bytes((keys / f"{name}.scope").read_bytes())
        kind = "upstream" if name == "upstream" else "device"
        add_principal(principals, name=name, kind=kind, keys=[name],
                      token_out=tokens / f"{name}.token",
                      device_id=None if kind == "upstream" else name)
        who[name] = Principal(name, load_signing_key(priv),
                              (tokens / f"{name}.token").read_text().strip())
    return principals, trusted, who


@contextmanager
def serve_registry(where: Path, env: dict[str, str],
                   devices: Sequence[str] = ("dev-a", "dev-b"),
                   *extra: str) -> Iterator[ServedRegistry]:
    """``python -m registry.serve`` with upstream and ``devices`` as principals; ``extra``
    adds command line options (limits)."""
    principals, trusted, who = provision(where / "provision", list(devices))
    root = where / "registry"
    root.mkdir()
    with open(where / "serve.log", "wb") as log:  # its refusals, for a failing test's reader
        proc = subprocess.Popen(
            [sys.executable, "-m", "registry.serve", str(root), "--principals", str(principals),
             "--trusted-keys", str(trusted), "--min-free-bytes", "0", *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
        )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield ServedRegistry(root, url, proc, trusted, who)
    finally:
        proc.terminate()
        proc.wait(10)
