"""A real ``edge-agent`` subprocess against a real mosquitto; READY is read from a bound
datagram socket standing in for systemd's ``$NOTIFY_SOCKET``."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.device import ProvisionedDevice, copy_device, provision_template
from tests.support.mosquitto import Broker
from tests.support.registry_fixtures import KeyPair, upstream_key  # noqa: F401

REPO = Path(__file__).resolve().parents[3]
_ids = itertools.count()


def command(type_: str, id: str | None = None, **extra: Any) -> dict[str, Any]:
    """A contract command envelope (``args=...``, ``expires_at=...`` via ``extra``)."""
    now = datetime.now(timezone.utc)
    body: dict[str, Any] = {"v": 1, "id": id or f"c{next(_ids)}-{os.getpid()}", "type": type_,
                            "issued_at": now.isoformat()}
    body.update(extra)
    return body


def expired_at() -> str:
    return (datetime.now(timezone.utc) - timedelta(seconds=5)).isoformat()


NOTIFY_PREFIX = "sd-notify-"


class Notify:
    """A bound AF_UNIX datagram socket: what systemd listens on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, str]] = []

    def drain(self, timeout_s: float) -> list[tuple[float, str]]:
        self.sock.settimeout(0.05)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                self.messages.append((time.monotonic(), self.sock.recv(4096).decode()))
            except TimeoutError:
                continue
        return self.messages

    def wait_for(self, text: str, timeout_s: float = 20.0) -> float:
        self.sock.settimeout(0.1)
        end = time.monotonic() + timeout_s
        for at, m in self.messages:
            if text in m.split("\n"):
                return at
        while time.monotonic() < end:
            try:
                m = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            now = time.monotonic()
            self.messages.append((now, m))
            if text in m.split("\n"):
                return now
        raise AssertionError(f"no {text!r} from the daemon in {timeout_s}s: {self.messages}")

    def close(self) -> None:
        self.sock.close()
        if self.path.parent.name.startswith(NOTIFY_PREFIX):
            shutil.rmtree(self.path.parent, ignore_errors=True)


class AgentProc:
    """``python -m agent.daemon --config agent.yaml`` with its own state dir."""

    def __init__(self, workdir: Path, broker: Broker, device: str, env: dict[str, str],
                 **cfg: Any) -> None:
        self.workdir = workdir
        self.device = device
        self.state_dir = workdir / "state"
        config: dict[str, Any] = {
            "device_id": device, "state_dir": str(self.state_dir), "sensors": "none",
            "telemetry_s": 0, "socket_group": None,
            "mqtt": {**broker.agent_mqtt(), "keepalive_s": 5,
                     "reconnect_min_s": 0.1, "reconnect_max_s": 1.0},
            "limits": {"progress_interval_s": 0.2},
        }
        for k, v in cfg.items():
            if isinstance(v, dict) and isinstance(config.get(k), dict):
                config[k].update(v)
            else:
                config[k] = v
        self.state_dir = Path(config["state_dir"])
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "agent.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.notify: Notify | None = None
        self.log = workdir / "daemon.log"

    def start(self, *, wait_ready: bool = True, watchdog_usec: int | None = None) -> AgentProc:
        if self.notify is not None:
            self.notify.close()
        # A socket path has at most 107 bytes (sun_path): a short folder of its own, not the
        # test's (deep under a parallel run's basetemp), as systemd's /run/systemd/notify is.
        path = Path(tempfile.mkdtemp(prefix=NOTIFY_PREFIX)) / "notify.sock"
        self.notify = Notify(path)
        env = dict(self.env, NOTIFY_SOCKET=str(path))
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.daemon", "--config", str(self.config),
                 "--log-format", "text"], stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=REPO,
            )
        if wait_ready:
            self.notify.wait_for("READY=1")
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self, timeout_s: float = 35) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def socket_request(self, req: dict[str, Any], timeout_s: float = 30) -> list[dict[str, Any]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(self.state_dir / "agent.sock"))
            f = s.makefile("rwb")
            f.write(json.dumps(req).encode() + b"\n")
            f.flush()
            out = []
            for line in f:
                obj = json.loads(line)
                out.append(obj)
                if obj.get("end") or "error" in obj or op_done(req, obj):
                    break
            return out

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def op_done(req: dict[str, Any], obj: dict[str, Any]) -> bool:
    return req.get("op") != "command" and bool(obj)


def secret_file(path: Path, text: str) -> Path:
    """A credential as provisioning leaves it: one line, mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def assert_active_verified(state: Path, version: str, model: str = "digits") -> Any:
    """The active slot holds ``version`` and verifies against the device's own trusted keys
    (signature and every tensor's hash), read the way the agent reads them."""
    from agent.storage.slots import ModelSlots
    from agent.storage.trust import load_trusted
    from agent.storage.verify import verify_slot

    active = ModelSlots(state, model).active()
    assert active is not None and active.version == version, active
    return verify_slot(active.path, load_trusted(state / "trusted_keys"))


@pytest.fixture
def agent(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> Iterator[Callable[..., AgentProc]]:
    """``agent(broker, device="dev-a", **config)`` -> a started AgentProc; stopped after."""
    started: list[AgentProc] = []

    def start(broker: Broker, device: str = "dev-a", *, wait_ready: bool = True,
              **cfg: Any) -> AgentProc:
        a = AgentProc(tmp_path / f"agent-{device}-{len(started)}", broker, device,
                      subprocess_env, **cfg)
        started.append(a)
        return a.start(wait_ready=wait_ready)

    yield start
    for a in started:
        if a.proc is not None and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait(10)
        if a.notify is not None:
            a.notify.close()


@pytest.fixture(scope="session")
def device_template(
    tmp_path_factory: pytest.TempPathFactory, upstream_key: KeyPair  # noqa: F811
) -> ProvisionedDevice:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return provision_template(tmp_path_factory.mktemp("device"), upstream_key, env)


@pytest.fixture
def device(device_template: ProvisionedDevice, tmp_path: Path) -> ProvisionedDevice:
    """A state dir with digits@1 active, its keys, and the device data: pass
    ``**device.agent_config()`` to ``agent(...)``."""
    return copy_device(device_template, tmp_path / "device-state")
