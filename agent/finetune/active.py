"""Load the active model of a device, re-verified (needs torch, imported only when a model is
loaded; kept out of ``agent.storage``, which stays torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.storage.assemble import MODEL_FILE
from agent.storage.nofollow import read_bytes
from agent.storage.slots import ModelSlots
from agent.storage.verify import read_signature, verify_slot
from registry.errors import NoActiveModelError
from registry.safetensors_io import read_safetensors_index
from registry.signing import TrustedKey, verify_signed_manifest


@dataclass
class LoadedModel:
    module: Any
    """torch.nn.Module with the slot's weights, in eval mode."""
    manifest: Any
    slot: Path


def load_active(
    state_dir: Path,
    name: str,
    *,
    trusted: dict[str, TrustedKey] | None = None,
    verify: bool = False,
    device: str = "cpu",
    allow_custom: bool = False,
) -> LoadedModel:
    """Build the active model and load its weights through safetensors (never a pickle).

    ``trusted`` re-checks the signature and the key's scope; ``verify`` also re-hashes every
    tensor.
    """
    from safetensors.torch import load_file

    from hpc_core.model_spec import build_module, check_against_spec

    active = ModelSlots(state_dir, name).active()
    if active is None:
        raise NoActiveModelError(f"no model {name!r} is installed in {state_dir}")
    if verify:
        manifest = verify_slot(active.path, trusted)
    else:
        manifest = active.manifest
        if trusted is not None:
            manifest, _ = verify_signed_manifest(
                read_bytes(active.path / "manifest.json"), read_signature(active.path), trusted,
                source=str(active.path),
            )
        read_safetensors_index(active.path / MODEL_FILE)  # refuses a pickle swapped in
    check_against_spec(manifest, allow_custom=allow_custom)
    module = build_module(manifest.model, allow_custom=allow_custom)
    module.load_state_dict(load_file(str(active.path / MODEL_FILE), device=device), strict=True)
    return LoadedModel(module.to(device).eval(), manifest, active.path)
