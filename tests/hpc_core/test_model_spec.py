"""The model spec check: a manifest's tensors against the module its spec builds, in process
and as the ``python -m hpc_core.model_spec check`` child a device pull runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpc_core.model_spec import check_against_spec
from registry.errors import SpecMismatchError
from tests.support.manifests import manifest_for, model_state, parse


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
