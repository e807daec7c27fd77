"""A pull checks the model spec in a torch child process: the pulling process stays torch-free,
a child that fails in any way refuses the version, a pass is remembered per layout."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
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


@pytest.fixture(autouse=True)
def nothing_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_check, "_PASSED", OrderedDict())


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


def test_a_failing_child_refuses_and_a_pass_is_remembered(
    new_model: Any, publisher: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = manifest_bytes(publisher, publisher.publish(new_model(), "1").manifest.version)
    good = Manifest.from_bytes(data)
    check_model_spec(good, data)  # the real child: passes

    # From here every child fails to start: only a remembered verdict can pass.
    monkeypatch.setattr(spec_check, "CHILD_MODULE", "tests.no_such_module")
    check_model_spec(good, data)
    other, other_bytes = with_spec(data, num_classes=11)
    with pytest.raises(SpecMismatchError, match=r"spec check failed .*exit 1.*no_such_module"):
        check_model_spec(other, other_bytes)
    # A custom factory is code: its pass is never remembered.
    custom, custom_bytes = with_spec(data, name="tests.user_model:build", kwargs={})
    spec_check._PASSED[spec_check.layout_key(custom)] = None
    with pytest.raises(SpecMismatchError, match="spec check failed"):
        check_model_spec(custom, custom_bytes, allow_custom=True)


def test_a_stuck_child_is_refused_within_its_timeout(new_model: Any, publisher: Any) -> None:
    data = manifest_bytes(publisher, publisher.publish(new_model(), "1").manifest.version)
    with pytest.raises(SpecMismatchError, match="did not finish within"):
        check_model_spec(Manifest.from_bytes(data), data, timeout_s=0.05)
