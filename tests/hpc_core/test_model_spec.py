"""The model spec check: a manifest's tensors against the module its spec builds, in process
and as the ``python -m hpc_core.model_spec check`` child a device pull runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hpc_core.config import ModelConfig
from hpc_core.model_spec import check_against_spec
from hpc_core.models import build_model
from registry.chunks import lay_out
from registry.errors import SpecMismatchError
from registry.manifest import Manifest, Signer, utc_now
from registry.safetensors_io import read_safetensors_index

SPEC = ModelConfig(name="mlp", kwargs={"hidden": [64, 64]}, num_classes=10, in_channels=1,
                   image_size=8)
CHUNK, PACK = 4096, 1024


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = build_model(SPEC.name, num_classes=10, in_channels=1, image_size=8, **SPEC.kwargs)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def manifest_for(path: Path, state: dict[str, torch.Tensor]) -> tuple[Manifest, dict]:
    save_file(state, str(path))
    layout = lay_out(read_safetensors_index(path), chunk_size=CHUNK, pack_below=PACK)
    m = Manifest(name="digits", version="1", sequence=1, created_at=utc_now(),
                 signer=Signer(key_id="0" * 16, name="t"), model=SPEC, chunk_size=CHUNK,
                 pack_below=PACK, chunks=layout.chunks, tensors=layout.tensors,
                 artefacts=layout.artefacts)
    return m, m.model_dump(mode="json")


def parse(doc: dict) -> Manifest:
    return Manifest.from_bytes(json.dumps(doc).encode())


def test_spec_check_names_the_mismatching_tensor(tmp_path: Path) -> None:
    m, doc = manifest_for(tmp_path / "m.safetensors", model_state())
    check_against_spec(m)
    doc["model"]["kwargs"] = {"hidden": [64, 32]}
    with pytest.raises(SpecMismatchError, match=r"3\.weight.*F32\[64, 64\].*needs F32\[32, 64\]"):
        check_against_spec(parse(doc))
    doc["model"]["kwargs"] = {"hidden": [64]}
    with pytest.raises(SpecMismatchError, match="unexpected tensor"):
        check_against_spec(parse(doc))
    doc["model"] = {**doc["model"], "name": "os:system", "kwargs": {}}
    with pytest.raises(SpecMismatchError, match="custom models"):
        check_against_spec(parse(doc))


def test_spec_check_catches_a_dtype_change(tmp_path: Path) -> None:
    state = {k: (v.half() if k == "1.weight" else v) for k, v in model_state().items()}
    m, _ = manifest_for(tmp_path / "m.safetensors", state)
    with pytest.raises(SpecMismatchError, match=r"1\.weight: manifest has F16"):
        check_against_spec(m)


def run_check(manifest: Path, env: dict[str, str], *extra: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "hpc_core.model_spec", "check", "--manifest", str(manifest),
         *extra], capture_output=True, text=True, env=env, timeout=300,
    )


def test_check_command_exit_codes(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    m, doc = manifest_for(tmp_path / "m.safetensors", model_state())
    good = tmp_path / "good.json"
    good.write_bytes(m.to_bytes())
    ok = run_check(good, subprocess_env)
    assert ok.returncode == 0, ok.stderr
    peak = json.loads(ok.stdout.splitlines()[-1])["peak_rss_bytes"]
    assert peak > 50e6  # the child holds torch: that is why it is a child

    doc["model"]["kwargs"] = {"hidden": [64, 32]}
    bad = tmp_path / "bad.json"
    bad.write_bytes(parse(doc).to_bytes())
    refused = run_check(bad, subprocess_env)
    assert refused.returncode == 3
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("digits@1 does not match its model spec: tensor 3.bias: manifest has")
    assert "tensor 3.weight: manifest has F32[64, 64], model mlp needs F32[32, 64]" in last

    missing = run_check(tmp_path / "nothing.json", subprocess_env)
    assert missing.returncode == 2
    assert "cannot check" in missing.stderr and "nothing.json" in missing.stderr
