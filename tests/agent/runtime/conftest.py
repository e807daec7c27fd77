"""A device state dir whose versions are real, signed slots with a real ONNX artefact, staged
and committed through ``ModelSlots`` as the device job does, in milliseconds and without torch.

Each version's ONNX file is a tiny linear model (input [N,1,8,8] -> logits [N,10]) whose
bias is ``[k, 0, ..., 0]`` for version ``k``: a zero batch scores ``k`` in column 0, so a
test reads off every answer which version served it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

from agent.storage.chunk_store import ChunkStore
from agent.storage.slots import InstalledSlot, ModelSlots, SwitchResult
from registry.chunks import ArtefactSource
from registry.manifest import ChunkRef
from registry.model_config import ModelConfig
from registry.publish import collect_artefacts, sign_version
from registry.safetensors_io import read_safetensors_index
from registry.signing import SigningKey, generate_keypair, load_signing_key, load_trusted_keys

MODEL = "digits"
SPEC = ModelConfig(name="mlp", kwargs={}, num_classes=10, in_channels=1, image_size=8)
INPUT_SHAPE = (1, 8, 8)


def tiny_onnx(path: Path, version: int) -> Path:
    """Flatten -> MatMul + bias: logits[:, 0] of a zero batch == ``version``."""
    weights = np.random.default_rng(0).standard_normal((64, 10)).astype(np.float32)
    bias = np.zeros(10, np.float32)
    bias[0] = version
    inits = [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")]
    nodes = [helper.make_node("Flatten", ["input"], ["flat"], axis=1),
             helper.make_node("MatMul", ["flat", "w"], ["mo"]),
             helper.make_node("Add", ["mo", "b"], ["logits"])]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                      ["batch", *INPUT_SHAPE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)
    return save_graph(graph, path)


def save_graph(graph: onnx.GraphProto, path: Path) -> Path:
    """``graph`` as a checked opset-17 model file at ``path`` (IR 8: every ONNX Runtime here
    loads it)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def served_version(logits: np.ndarray) -> int:
    """The version that scored a zero batch (every row must agree)."""
    col = logits[:, 0]
    assert np.all(col == col[0]), f"one batch scored by two versions: {col}"
    return int(col[0])


@dataclass
class Device:
    """A state dir and the key its versions are signed with."""

    state: Path
    work: Path
    key: SigningKey
    trusted_dir: Path
    name: str = MODEL

    @property
    def slots(self) -> ModelSlots:
        return ModelSlots(self.state, self.name)

    def artefacts(self, version: int, *, onnx_file: bool = True,
                  onnx_from: Path | None = None) -> list[ArtefactSource]:
        """The version's artefacts: its tiny ONNX file (or a copy of ``onnx_from``)."""
        folder = self.work / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        if onnx_from is not None:
            paths.append(folder / "model.onnx")
            paths[0].write_bytes(onnx_from.read_bytes())
        elif onnx_file:
            paths.append(tiny_onnx(folder / "model.onnx", version))
        return collect_artefacts(paths)

    def stage(self, version: int, **artefacts: object) -> InstalledSlot:
        """Sign version ``version`` (its sequence too) and stage it in the standby slot."""
        weights = self.work / "model.safetensors"
        if not weights.exists():
            weights.parent.mkdir(parents=True, exist_ok=True)
            save_file({"w": np.zeros((10, 64), np.float32)}, str(weights))
        store = ChunkStore(self.state)

        def keep_chunk(ref: ChunkRef, data: bytes) -> None:
            if store.has(ref.sha256):
                return
            with store.append_partial(ref.sha256) as f:
                f.truncate(0)
                f.write(data)
            store.commit_partial(ref.sha256)

        signed = sign_version(name=self.name, version=str(version), sequence=version,
                              model=SPEC, tensors=read_safetensors_index(weights),
                              key=self.key, on_chunk=keep_chunk,
                              artefacts=self.artefacts(version, **artefacts))  # type: ignore[arg-type]
        from registry.signing import verify_signed_manifest

        manifest, verified_by = verify_signed_manifest(
            signed.manifest_bytes, signed.signature_bytes, load_trusted_keys(self.trusted_dir))
        return self.slots.stage(manifest, signed.manifest_bytes, signed.signature_bytes, store,
                                verified_by)

    def commit(self, version: int) -> SwitchResult:
        return self.slots.commit(str(version))

    def install(self, version: int, **artefacts: object) -> SwitchResult:
        self.stage(version, **artefacts)
        return self.commit(version)


@pytest.fixture(scope="session")
def runtime_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[SigningKey, Path]:
    where = tmp_path_factory.mktemp("runtime-keys")
    priv, pub = generate_keypair(where, "upstream")
    trusted = where / "trusted"
    trusted.mkdir()
    (trusted / pub.name).write_bytes(pub.read_bytes())
    return load_signing_key(priv), trusted


@pytest.fixture
def make_device(tmp_path: Path, runtime_key: tuple[SigningKey, Path]) -> Callable[..., Device]:
    def make(name: str = "dev") -> Device:
        state = tmp_path / name / "state"
        state.mkdir(parents=True)
        return Device(state, tmp_path / name / "work", runtime_key[0], runtime_key[1])

    return make


@pytest.fixture
def device(make_device: Callable[..., Device]) -> Device:
    """A state dir with no model committed yet."""
    return make_device()
