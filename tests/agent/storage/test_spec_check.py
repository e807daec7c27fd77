"""A pull checks the model spec before any chunk moves, torch-free: a registered model in
process (``hpc_core.model_layout``), a custom factory in a torch child process, every time,
whose failure in any way refuses the version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.storage import spec_check
from agent.storage.spec_check import check_model_spec
from registry.errors import SpecMismatchError
from registry.manifest import Manifest

TORCH_FREE_PULL = (
    "import sys\n"
    "from agent.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('torch imported:', 'torch' in sys.modules)\n"
    "sys.exit(code)\n"
)


def test_agentctl_pull_never_imports_torch(
    new_model: Any, registry_server: Any, publisher: Any, upstream_key: Any, tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    publisher.publish(new_model(), "1")
    publisher.spec = {**publisher.spec, "kwargs": {"hidden": [32]}}  # signed, but the wrong spec
    publisher.publish(new_model(), "2", parent="1")
    base = [sys.executable, "-c", TORCH_FREE_PULL, "pull", "--registry", registry_server.url,
            "--state-dir", str(tmp_path / "state"), "--trusted-keys", str(upstream_key.trusted_dir)]
    ok = subprocess.run([*base, "digits@1"], capture_output=True, text=True, env=subprocess_env,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "digits@1 active" in ok.stdout and "torch imported: False" in ok.stdout
    refused = subprocess.run([*base, "digits@2"], capture_output=True, text=True,
                             env=subprocess_env, timeout=300)
    assert refused.returncode == 3, refused.stderr
    assert "refused (SpecMismatchError): digits@2 does not match its model spec" in refused.stderr
    assert "torch imported: False" in refused.stdout


def manifest_bytes(publisher: Any, version: str) -> bytes:
    return (publisher.root / "digits" / version / "manifest.json").read_bytes()


def with_spec(data: bytes, **model: Any) -> tuple[Manifest, bytes]:
    doc = json.loads(data)
    doc["model"].update(model)
    m = Manifest.model_validate(doc)
    return m, m.to_bytes()


CUSTOM = "tests.agent.storage.custom_model:build"


def test_a_registered_model_is_checked_without_a_child(
    new_model: Any, publisher: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = manifest_bytes(publisher, publisher.publish(new_model(), "1").manifest.version)
    # Every child fails to start: only a check that needs none can pass or name the tensor.
    monkeypatch.setattr(spec_check, "CHILD_MODULE", "tests.no_such_module")
    check_model_spec(Manifest.from_bytes(data), data)
    other, other_bytes = with_spec(data, num_classes=11)
    with pytest.raises(SpecMismatchError, match=r"spec: tensor 17\.bias: manifest has F32\[10\]"):
        check_model_spec(other, other_bytes)
    custom, custom_bytes = with_spec(data, name=CUSTOM)
    with pytest.raises(SpecMismatchError, match="refused unless custom models are allowed"):
        check_model_spec(custom, custom_bytes)


SPEC_CHECK = (
    "import sys\n"
    "from agent.storage.spec_check import check_model_spec\n"
    "from registry.errors import SpecMismatchError\n"
    "from registry.manifest import Manifest\n"
    "for path in sys.argv[1:]:\n"
    "    data = open(path, 'rb').read()\n"
    "    try:\n"
    "        check_model_spec(Manifest.from_bytes(data), data)\n"
    "        print('passed')\n"
    "    except SpecMismatchError as e:\n"
    "        print('refused:', e)\n"
    "print('torch imported:', 'torch' in sys.modules)\n"
)


def test_the_spec_check_never_imports_torch(
    new_model: Any, publisher: Any, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    data = manifest_bytes(publisher, publisher.publish(new_model(), "1").manifest.version)
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_bytes(data)
    bad.write_bytes(with_spec(data, kwargs={"hidden": [128] * 7})[1])
    done = subprocess.run([sys.executable, "-c", SPEC_CHECK, str(good), str(bad)],
                          capture_output=True, text=True, env=subprocess_env, timeout=60,
                          check=True)
    lines = done.stdout.splitlines()
    assert lines[0] == "passed"
    assert lines[1].startswith("refused: digits@1 does not match its model spec: ")
    assert lines[2] == "torch imported: False"


def test_a_custom_factory_is_checked_in_a_torch_child_every_time(
    new_model: Any, publisher: Any, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = manifest_bytes(publisher, publisher.publish(new_model(), "1").manifest.version)
    custom, custom_bytes = with_spec(data, name=CUSTOM)
    with caplog.at_level("INFO", logger="agent.storage"):
        check_model_spec(custom, custom_bytes, allow_custom=True)  # the real child: passes
    peaks = [r.fields["peak_rss_bytes"] for r in caplog.records  # type: ignore[attr-defined]
             if getattr(r, "fields", {}).get("event") == "spec_check"]
    assert len(peaks) == 1 and peaks[0] > 50e6  # the child held torch, not this process
    wrong, wrong_bytes = with_spec(custom_bytes, num_classes=11)
    with pytest.raises(SpecMismatchError, match="does not match its model spec"):
        check_model_spec(wrong, wrong_bytes, allow_custom=True)
    # A custom factory is code that may change between two pulls: its pass is never
    # remembered, and a child that fails in any way refuses the version.
    monkeypatch.setattr(spec_check, "CHILD_MODULE", "tests.no_such_module")
    with pytest.raises(SpecMismatchError, match=r"spec check failed .*exit 1.*no_such_module"):
        check_model_spec(custom, custom_bytes, allow_custom=True)


def test_a_stuck_child_is_refused_within_its_timeout(new_model: Any, publisher: Any) -> None:
    data = manifest_bytes(publisher, publisher.publish(new_model(), "1").manifest.version)
    custom, custom_bytes = with_spec(data, name=CUSTOM)
    with pytest.raises(SpecMismatchError, match="did not finish within"):
        check_model_spec(custom, custom_bytes, allow_custom=True, timeout_s=0.05)
