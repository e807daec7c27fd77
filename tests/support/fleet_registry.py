"""A folder registry of upstream releases and device-signed fine-tunes made from numpy arrays.

Torch-free: the aggregation tests and ``benchmarks/aggregate.py`` publish tensors they
compute, signed as ``hpc-train publish`` (the upstream key, no scope) and a device upload
(``registry.upload``: the device's own key, scope ``NAME@*+DEVICE.*``, parent and base the
release it fine-tuned) sign them.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from registry.manifest import Manifest, TrainingInfo
from registry.model_config import ModelConfig
from registry.names import chunk_key
from registry.publish import publish_version
from registry.safetensors_io import read_safetensors_index
from registry.signing import SigningKey, generate_keypair, load_signing_key
from registry.stores import LocalStore

# Nothing here builds the module (the aggregation never does): the spec only has to be
# resolved and identical between the base and its updates.
SPEC = ModelConfig(name="mlp", kwargs={"hidden": [8]}, num_classes=2, in_channels=1,
                   image_size=2)
STAMP = "20261126T000000Z"
SAMPLES = "train/samples"

Tensors = dict[str, np.ndarray]


@dataclass
class FleetRegistry:
    root: Path
    """The registry folder."""
    work: Path
    """Scratch: keys and the safetensors files published from."""
    trusted: Path
    """The trusted-keys folder an aggregation reads (upstream + trusted devices)."""
    upstream: SigningKey
    name: str = "digits"
    spec: ModelConfig = field(default_factory=SPEC.model_copy)
    chunk_size: int = 16 << 10
    pack_below: int = 4 << 10
    _count: itertools.count = field(default_factory=lambda: itertools.count(1))
    _keys: dict[str, SigningKey] = field(default_factory=dict)

    @classmethod
    def create(cls, where: Path, **kwargs: object) -> FleetRegistry:
        where.mkdir(parents=True, exist_ok=True)
        root, work, trusted = where / "registry", where / "work", where / "trusted"
        for p in (root, work, trusted):
            p.mkdir()
        priv, pub = generate_keypair(work / "keys", "upstream")
        shutil.copy(pub, trusted / pub.name)
        return cls(root, work, trusted, load_signing_key(priv), **kwargs)  # type: ignore[arg-type]

    @property
    def store(self) -> LocalStore:
        return LocalStore(self.root)

    def device(self, device_id: str, *, trusted: bool = True,
               scope: str | None = None) -> SigningKey:
        """A device's key (made once per id); trusted: its public half and scope file go to
        ``self.trusted``."""
        if device_id in self._keys:
            return self._keys[device_id]
        pattern = scope or f"{self.name}@*+{device_id}.*"
        priv, pub = generate_keypair(self.work / "keys", device_id, scope=[pattern])
        if trusted:
            shutil.copy(pub, self.trusted / pub.name)
            shutil.copy(pub.with_name(f"{device_id}.scope"), self.trusted / f"{device_id}.scope")
        self._keys[device_id] = load_signing_key(priv)
        return self._keys[device_id]

    def _sources(self, tensors: Tensors, label: str) -> list:
        path = self.work / f"{label}-{next(self._count)}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
        return read_safetensors_index(path)

    def release(self, version: str, tensors: Tensors, *, parent: Manifest | None = None,
                spec: ModelConfig | None = None) -> Manifest:
        """An upstream release signed with the upstream key."""
        report = publish_version(
            self.store, name=self.name, version=version, model=spec or self.spec,
            tensors=self._sources(tensors, f"release-{version}"), key=self.upstream,
            parent=parent.version if parent else None,
            parent_seq=parent.sequence if parent else 0,
            chunk_size=self.chunk_size, pack_below=self.pack_below,
        )
        return report.manifest

    def update(self, key: SigningKey, release: Manifest, tensors: Tensors, *,
               samples: float | None = None, version: str | None = None,
               parent: Manifest | None = None, spec: ModelConfig | None = None) -> Manifest:
        """A device fine-tune of ``release`` signed with the device's ``key``."""
        n = next(self._count)
        version = version or f"{release.version}+{key.name}.{STAMP}.{n}"
        parent = parent or release
        metrics = {SAMPLES: float(samples)} if samples is not None else {}
        report = publish_version(
            self.store, name=self.name, version=version, model=spec or self.spec,
            tensors=self._sources(tensors, f"update-{n}"), key=key, parent=parent.version,
            parent_seq=parent.sequence, base=parent.base_release,
            training=TrainingInfo(metrics=metrics),
            chunk_size=self.chunk_size, pack_below=self.pack_below,
        )
        return report.manifest

    def fine_tunes(self, release: Manifest, base: Tensors, deltas: list[Tensors], *,
                   samples: list[float | None] | None = None,
                   prefix: str = "dev") -> list[Manifest]:
        """Device ``{prefix}-{i}`` uploads ``base + deltas[i]``, a fine-tune of ``release``."""
        out = []
        for i, delta in enumerate(deltas):
            tensors = {k: (v + delta[k]).astype(v.dtype) if k in delta else v
                       for k, v in base.items()}
            out.append(self.update(self.device(f"{prefix}-{i}"), release, tensors,
                                   samples=samples[i] if samples else None))
        return out

    def chunk_path(self, manifest: Manifest, tensor: str) -> Path:
        """The file of the first chunk holding ``tensor``'s bytes."""
        entry = next(t for t in manifest.tensors if t.name == tensor)
        offsets = manifest.chunk_offsets()
        i = max(j for j, off in enumerate(offsets) if off <= entry.offset)
        return self.store.path(chunk_key(manifest.chunks[i].sha256))
