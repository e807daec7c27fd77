"""A small model's state dict and its manifest, for the tests of the manifest schema
(tests/registry) and of the spec check (tests/hpc_core): one definition for both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hpc_core.models import build_model
from registry.chunks import lay_out
from registry.manifest import Manifest, Signer, utc_now
from registry.model_config import ModelConfig
from registry.safetensors_io import read_safetensors_index

SPEC = ModelConfig(name="mlp", kwargs={"hidden": [64, 64]}, num_classes=10, in_channels=1,
                   image_size=8)
CHUNK, PACK = 4096, 1024


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = build_model(SPEC.name, num_classes=10, in_channels=1, image_size=8, **SPEC.kwargs)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def manifest_for(path: Path, state: dict[str, torch.Tensor], **extra: Any) -> tuple[Manifest, dict]:
    save_file(state, str(path))
    layout = lay_out(read_safetensors_index(path), chunk_size=CHUNK, pack_below=PACK, **extra)
    m = Manifest(name="digits", version="1", sequence=1, created_at=utc_now(),
                 signer=Signer(key_id="0" * 16, name="t"), model=SPEC, chunk_size=CHUNK,
                 pack_below=PACK, chunks=layout.chunks, tensors=layout.tensors,
                 artefacts=layout.artefacts)
    return m, m.model_dump(mode="json")


def parse(doc: dict) -> Manifest:
    return Manifest.from_bytes(json.dumps(doc).encode())
