"""Attack tests' set-up: a real mosquitto running exactly what ``fleetctl broker-config``
writes, devices that speak the contract (honest or forging) and the real ``fleetctl``."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import yaml

from contract import (
    CommandRejected,
    Result,
    Status,
    Topics,
    parse_command,
    utc_now,
)
from fleet.cli import main as fleetctl_main
from tests.support.mosquitto import Broker, free_port, have_mosquitto
from tests.support.mqtt import Peer
from tests.support.pki import Pki

T = Topics()
INVENTORY = {"dev-a": ["lab"], "dev-b": ["lab", "other"]}
"""Device -> groups: A is the attacker, B its victim; only B is in ``other``."""


@dataclass
class SecureBroker:
    """One broker, two listeners, as provisioned by ``fleetctl broker-config``."""

    devices: Broker
    """The device listener (the running process)."""
    operators: Broker
    """The operator listener of the same process (for Peer's host/port)."""
    out: Path
    secrets: Path
    summary: dict[str, Any]
    tls: Pki | None = None

    def password(self, kind: str, name: str) -> str:
        return (self.secrets / kind / f"{name}.password").read_text().strip()

    def login(self, dev: str) -> dict[str, Any]:
        """Peer arguments for ``dev``'s own credentials: its password, or with mutual TLS its
        certificate (CN = dev)."""
        if self.tls is not None:
            return {"cert": self.tls.client(dev)}
        return {"username": dev, "password": self.password("devices", dev)}

    def device(self, dev: str, **kw: Any) -> Peer:
        """``dev`` logged in with its own account on the device listener."""
        kw.setdefault("client_id", dev)
        return Peer(self.devices, **self.login(dev), **kw)

    def operator(self, account: str, **kw: Any) -> Peer:
        return Peer(self.operators, username=account,
                    password=self.password("operators", account), **kw)

    def fleetctl_argv(self, account: str, tmp_path: Path) -> list[str]:
        """The real fleetctl on the operator listener, logged in as ``account``."""
        argv = [sys.executable, "-m", "fleet.cli", "--port", str(self.operators.port),
                "--username", account,
                "--password-file", str(self.secrets / "operators" / f"{account}.password"),
                "--db", str(tmp_path / "fleet.db"), "--report-dir", str(tmp_path / "reports"),
                "--settle-s", "0.3"]
        if self.tls is not None:
            argv[3:3] = ["--tls-ca", str(self.tls.ca_cert)]
        return argv


def provision(workdir: Path, inventory: dict[str, list[str]], *extra: str,
              tls: Pki | None = None) -> SecureBroker:
    """Run ``fleetctl broker-config`` as an operator would, then start mosquitto on its conf
    (plus only what a test run needs: ``user root`` to read the 0600 files, a log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    inv = workdir / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"devices": {d: {"groups": g} for d, g in inventory.items()}}))
    dev_port, op_port = free_port(), free_port()
    argv = ["broker-config", "--inventory", str(inv), "--out", str(workdir / "broker"),
            "--secrets", str(workdir / "secrets"), "--device-listener", f"127.0.0.1:{dev_port}",
            "--operator-listener", f"127.0.0.1:{op_port}", *extra]
    if tls is not None:
        argv += ["--cafile", str(tls.ca_cert), "--certfile", str(tls.server_cert),
                 "--keyfile", str(tls.server_key)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert fleetctl_main(argv) == 0
    summary = yaml.safe_load(buf.getvalue())
    conf = workdir / "broker" / "mosquitto.conf"
    test_conf = workdir / "mosquitto-test.conf"
    lines = [conf.read_text()]
    if os.geteuid() == 0:
        lines.append("user root")
    lines.append("log_type error\nlog_type warning\nlog_type notice\nlog_dest stderr")
    test_conf.write_text("\n".join(lines) + "\n")
    log = workdir / "mosquitto.log"
    devices = Broker("127.0.0.1", dev_port, test_conf, workdir, tls=tls, log=log).start()
    devices.wait_for_listener(op_port)  # the same process's second listener
    operators = Broker("127.0.0.1", op_port, test_conf, workdir, tls=tls, log=log)
    return SecureBroker(devices, operators, workdir / "broker", workdir / "secrets", summary,
                        tls)


@pytest.fixture
def secure_broker(tmp_path: Path) -> Iterator[Callable[..., SecureBroker]]:
    """``secure_broker(inventory=INVENTORY, *flags, tls=None)``: provisioned and started;
    stopped after the test. Skips without mosquitto."""
    if not have_mosquitto():
        pytest.skip("mosquitto is not installed (make services)")
    started: list[SecureBroker] = []
    n = itertools.count()

    def start(*extra: str, inventory: dict[str, list[str]] | None = None,
              tls: Pki | None = None) -> SecureBroker:
        sb = provision(tmp_path / f"secure-{next(n)}", inventory or INVENTORY, *extra, tls=tls)
        started.append(sb)
        return sb

    yield start
    for sb in started:
        sb.devices.stop()


# --- devices that speak the contract -------------------------------------------------------


@dataclass
class Behaviour:
    """How a fake device answers a command: ``answer(device, command) -> results`` to publish
    on the device's OWN result topic (each a Result, whatever device it names)."""

    answer: Callable[[FakeDevice, Any], list[Result]] = field(
        default=lambda dev, cmd: [dev.result(cmd.id, "SUCCEEDED")])
    delay_s: float = 0.0


class FakeDevice(Peer):
    """A device on its own account: retained status, its commands and its groups' commands,
    answered per ``behaviour`` (an attacker forges other devices' results there)."""

    def __init__(self, sb: SecureBroker, dev: str, groups: list[str],
                 behaviour: Behaviour | None = None, **kw: Any) -> None:
        self.dev, self.groups = dev, groups
        self.behaviour = behaviour or Behaviour()
        self.seq = itertools.count()
        self.commands: list[str] = []
        kw.setdefault("client_id", dev)
        super().__init__(sb.devices, **sb.login(dev), **kw)
        self.subscribe(T.device_commands(dev), *[T.group_commands(g) for g in groups])

    def result(self, cid: str, status: str, *, device: str | None = None,
               **kw: Any) -> Result:
        return Result(id=cid, device=device or self.dev, status=status,  # type: ignore[arg-type]
                      seq=next(self.seq), ts=utc_now(), **kw)

    def status(self, state: str = "online", *, device: str | None = None,
               conn_seq: int = 1, groups: list[str] | None = None) -> Status:
        return Status(state=state, device=device or self.dev, conn_seq=conn_seq,  # type: ignore[arg-type]
                      boot_id="boot", agent_version="test", ts=utc_now(),
                      groups=self.groups if groups is None else groups)

    def announce(self, state: str = "online", **kw: Any) -> Any:
        """Publish a retained status on this device's own status topic."""
        return self.publish(T.status(self.dev), self.status(state, **kw).to_payload(),
                            retain=True)

    def _on_message(self, c: Any, ud: Any, msg: mqtt.MQTTMessage) -> None:
        super()._on_message(c, ud, msg)
        try:
            kind, _, type_ = T.parse(msg.topic)
            cmd = parse_command(msg.payload, type_ or "")
        except (ValueError, CommandRejected):
            return  # not a command this fake answers (the tests send only good ones)
        if kind not in ("cmd", "group_cmd"):
            return
        self.commands.append(cmd.id)
        results = self.behaviour.answer(self, cmd)
        if self.behaviour.delay_s:
            threading.Timer(self.behaviour.delay_s, self._send, (results,)).start()
        else:
            self._send(results)

    def _send(self, results: list[Result]) -> None:
        for r in results:
            # Always this device's own topic: the broker lets it write nowhere else.
            self.client.publish(T.result(self.dev), r.to_payload(), qos=1)


def run_fleetctl(sb: SecureBroker, account: str, tmp_path: Path, env: dict[str, str],
                 *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(sb.fleetctl_argv(account, tmp_path) + list(args),
                          capture_output=True, text=True, timeout=timeout, env=env)
