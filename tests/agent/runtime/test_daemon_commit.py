"""The real thing: an ``edge-agent`` daemon deploys a registry version (pull, stage, health,
commit) while an application serves the model under load. The application's hold defers the
daemon's commit; once released, the commit lands and the application follows it with no
failed request."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.jobs.store import JobStore
from agent.runtime.active_model import ActiveModel
from agent.storage.update import update
from registry.refs import parse_ref
from registry.signing import load_trusted_keys
from tests.agent.daemon.conftest import AgentProc
from tests.agent.runtime.conftest import served_version, tiny_onnx
from tests.agent.runtime.test_active_model import wait_for
from tests.support.mosquitto import Broker, free_port
from tests.support.registry_fixtures import KeyPair, Publisher


def _registry_with_two_versions(root: Path, model: Any, key: KeyPair) -> Path:
    """digits@1 and digits@2: the test MLP's weights (the health check loads them) and an
    ONNX artefact each (what serves)."""
    reg, work = root / "registry", root / "checkpoints"
    reg.mkdir()
    work.mkdir()
    pub = Publisher(reg, work, key)
    for v in (1, 2):
        pub.publish(model, str(v), parent=str(v - 1) if v > 1 else None,
                    artefacts=(tiny_onnx(root / f"onnx{v}" / "model.onnx", v),))
    return reg


@pytest.mark.slow
def test_a_daemon_deploy_waits_for_the_hold_then_swaps_the_served_model_under_load(
        tmp_path: Path, new_model: Any, upstream_key: KeyPair,
        subprocess_env: dict[str, str]) -> None:
    reg = _registry_with_two_versions(tmp_path, new_model(0), upstream_key)
    state = tmp_path / "state"
    (state / "trusted_keys").mkdir(parents=True)
    for pub in upstream_key.trusted_dir.iterdir():
        (state / "trusted_keys" / pub.name).write_bytes(pub.read_bytes())
    update(parse_ref("digits@1", str(reg)), state_dir=state,
           trusted=load_trusted_keys(state / "trusted_keys"))
    nowhere = Broker("127.0.0.1", free_port(), tmp_path / "none.conf", tmp_path)  # no broker
    daemon = AgentProc(tmp_path / "agent", nowhere, "dev-a", subprocess_env,
                       state_dir=str(state), registry={"url": str(reg)},
                       limits={"update_lock_max_wait_s": 120})
    daemon.start()
    stop, seen, errors = threading.Event(), Counter[int](), []
    try:
        with ActiveModel(state, "digits", poll_s=0.05, threads=1) as model:
            def client() -> None:
                while not stop.is_set():
                    try:
                        seen[served_version(model.predict(np.zeros((2, 1, 8, 8),
                                                                   np.float32)))] += 1
                    except BaseException as e:
                        errors.append(e)
                        return

            clients = [threading.Thread(target=client) for _ in range(2)]
            for t in clients:
                t.start()
            store = JobStore(state)
            with model.hold_updates():
                r = subprocess.run([sys.executable, "-m", "agent.cli", "deploy", "digits", "2",
                                    "--id", "d1", "--state-dir", str(state)],
                                   env=subprocess_env, capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == 0 and "d1: ACCEPTED" in r.stdout, r.stdout + r.stderr

                def commit_waiting() -> bool:
                    return any(s.name == "commit" and s.status == "running"
                               for s in store.steps("d1"))

                wait_for(commit_waiting, 120, "the deploy to reach its commit")
                time.sleep(1.0)  # the daemon's commit waits on the hold...
                assert commit_waiting() and model.version == "1"
                assert (state / "models/digits/current").readlink() == Path("slots/a")
            # ... and lands once it ends; the application follows.
            wait_for(lambda: (r := store.get("d1")) is not None and r.terminal, 60,
                     "the deploy to end")
            rec = store.get("d1")
            assert rec is not None and rec.state.value == "SUCCEEDED", daemon.log_text()[-3000:]
            wait_for(lambda: seen[2] >= 20, 10, "v2 served")
            stop.set()
            for t in clients:
                t.join()
            assert model.stats().failed == 0 and model.stats().swaps == 1
    finally:
        stop.set()
        daemon.stop()
    assert errors == [] and set(seen) == {1, 2}
    (step,) = [s for s in JobStore(state).steps("d1") if s.name == "commit"]
    assert step.outputs is not None and step.outputs["update_lock_wait_s"] >= 1.0
