"""The forgetting gate: an upstream version ships an anchor set (``artefacts/anchor.safetensors``,
data of the upstream distribution); health scores the active and the staged model on it and
refuses a fine-tune that falls more than ``health.max_anchor_drop_pts`` below; a committed
fine-tune carries the anchor on, so the next fine-tune is held to it too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.jobs.store import JobStore
from tests.agent.jobs.conftest import REPO, Device


def _publish_with_anchor(device: Device, tmp_path: Path) -> None:
    """digits@v1-anchor: v1's weights with the clean digits as its anchor set."""
    sys.path.insert(0, str(REPO / "scripts"))
    import numpy as np
    from make_device_data import make_device_data
    from safetensors.numpy import save_file

    from hpc_core.model_spec import read_checkpoint
    from registry.publish import publish_content
    from registry.signing import load_signing_key
    from registry.stores import LocalStore

    clean = make_device_data(tmp_path / "clean.npz", [])  # no distortion
    with np.load(clean, allow_pickle=False) as z:
        (tmp_path / "anchor").mkdir()
        anchor = tmp_path / "anchor" / "anchor.safetensors"
        save_file({"x": z["x"], "y": z["y"]}, anchor)
    key = load_signing_key(Path((device.upstream.parent / "upstream.key").read_text()))
    publish_content(read_checkpoint(device.upstream), LocalStore(device.registry.root),
                    name="digits",
                    version="v1-anchor", key=key, artefacts=[anchor])


@pytest.mark.slow
def test_a_fine_tune_that_forgets_the_anchor_set_is_rolled_back(
        device: Device, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from agent.cli import main

    _publish_with_anchor(device, tmp_path)
    argv = ["finetune", "--model", "digits", "--version", "v1-anchor", "--registry",
            device.registry.url, "--data", str(device.data), "--state-dir", str(device.state),
            "--profile", "generic-x86", "--sensors", "none", "--trainable", "all",
            "--steps", "60", "--micro-batch", "64", "--lr", "0.05", "--no-export",
            "--health-max-accuracy-drop-pts", "100", "--progress", "json"]
    # The device's own data (inverted, noisy) pulls the model away from clean digits.
    assert main([*argv, "--job-id", "forget", "--health-max-anchor-drop-pts", "1"]) == 1
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    health = {s.name: s for s in JobStore(device.state).steps("forget")}["health"].outputs
    anchor = health["anchor"]
    assert anchor["samples"] == 1797 and anchor["max_drop_pts"] == 1.0
    assert anchor["drop_pts"] > 1.0, anchor
    assert final["result"]["outcome"] == "rolled_back"
    assert "health.max_anchor_drop_pts=1" in final["result"]["reason"]
    assert "anchor set" in final["result"]["reason"]

    # Not gated: the same fine-tune commits, scored all the same, and carries the anchor on.
    assert main([*argv, "--job-id", "keep", "--health-max-anchor-drop-pts", "off"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert final["result"]["outcome"] == "committed"
    health = {s.name: s for s in JobStore(device.state).steps("keep")}["health"].outputs
    assert health["anchor"]["max_drop_pts"] is None and health["passed"]
    current = device.state / "models" / "digits" / "current"
    carried = current / "artefacts" / "anchor.safetensors"
    assert carried.is_file()
    assert carried.read_bytes() == (tmp_path / "anchor" / "anchor.safetensors").read_bytes()
