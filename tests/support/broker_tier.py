"""A bridged broker tier (``fleetctl broker-config --core``) on real mosquitto processes: a
core and its regional brokers on loopback, started from exactly the files it writes.

``tier(*flags, inventory=INVENTORY, tls=None)`` (a fixture: import it into a conftest) provisions
and starts one, and waits until every region's bridge is connected; :class:`Tier` logs devices
in on their regions and operator tools on the core.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.cli import main as fleetctl_main
from fleet.mqtt import BrokerConfig
from tests.support.mosquitto import Broker, free_port, have_mosquitto, start_from_conf
from tests.support.mqtt import Peer
from tests.support.pki import Pki

INVENTORY = {
    "eu-1": {"groups": ["line-3"], "region": "eu"},
    "eu-2": {"groups": [], "region": "eu"},
    "us-1": {"groups": ["line-3", "canary"], "region": "us"},
}
"""Two regions; group line-3 has a device in each, eu-2 is in no group."""
CONNECTED = b"1"
"""mosquitto's bridge notification payload while a bridge is connected."""


@dataclass
class Tier:
    core: Broker
    """The core's process; its port is the operator listener (fleetctl's)."""
    bridge_port: int
    regions: dict[str, Broker]
    inventory: dict[str, dict[str, Any]]
    secrets: Path
    out: Path
    tls: Pki | None
    bridges: dict[str, list[str]]
    """Region -> its bridges' accounts (one unless a region has more devices per bridge)."""

    def password(self, kind: str, name: str) -> str:
        return (self.secrets / kind / f"{name}.password").read_text().strip()

    def device(self, dev: str, **kw: Any) -> Peer:
        """``dev`` on its own region's broker with its own account (client id = account)."""
        return Peer(self.regions[self.inventory[dev]["region"]], client_id=dev, username=dev,
                    password=self.password("devices", dev), **kw)

    def operator(self, account: str, **kw: Any) -> Peer:
        return Peer(self.core, username=account, password=self.password("operators", account),
                    **kw)

    def bridge_listener(self) -> Broker:
        """The core's bridge listener (for Peer's host and port; the core's process)."""
        return Broker("127.0.0.1", self.bridge_port, self.core.conf, self.core.workdir)

    def broker_config(self, account: str) -> BrokerConfig:
        """The fleet's own client settings for ``account`` on the core."""
        return BrokerConfig(port=self.core.port, username=account,
                            password_file=self.secrets / "operators" / f"{account}.password",
                            tls_ca=self.tls.ca_cert if self.tls else None)

    def wait_bridges(self, watch: Peer, *regions: str, since: float = 0.0,
                     timeout_s: float = 20.0) -> None:
        """Until these (default: all) regions' bridges say they are connected, after
        monotonic ``since``."""
        for b in (b for r in regions or self.regions for b in self.bridges[r]):
            watch.wait_for(lambda m, b=b: m.topic == f"$SYS/broker/connection/{b}/state"
                           and m.payload == CONNECTED and m.at >= since, timeout_s=timeout_s)

    def stop(self) -> None:
        for b in (*self.regions.values(), self.core):
            b.stop()


def provision(workdir: Path, inventory: dict[str, dict[str, Any]], *extra: str,
              tls: Pki | None = None) -> Tier:
    """``fleetctl broker-config --core`` as an operator runs it (``extra``: more of its
    flags), then the core and each region started on what it wrote (the core first: the
    bridges dial it)."""
    inv = workdir / "inventory.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    inv.write_text(yaml.safe_dump({"devices": inventory}))
    regions = sorted({d["region"] for d in inventory.values()})
    ports = {r: free_port() for r in regions}
    bridge, op = free_port(), free_port()
    argv = ["broker-config", "--inventory", str(inv), "--out", str(workdir / "tier"),
            "--secrets", str(workdir / "secrets"), "--core", f"127.0.0.1:{bridge}",
            "--bridge-listener", f"127.0.0.1:{bridge}", "--operator-listener", f"127.0.0.1:{op}"]
    for r, p in ports.items():
        argv += ["--region", f"{r}=127.0.0.1:{p}"]
    argv += extra
    if tls is not None:
        argv += ["--cafile", str(tls.ca_cert), "--certfile", str(tls.server_cert),
                 "--keyfile", str(tls.server_key)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert fleetctl_main(argv) == 0
    summary = json.loads(buf.getvalue())
    out = workdir / "tier"
    core = start_from_conf(out / "core" / "mosquitto.conf", op, workdir, tls=tls)
    started = {r: start_from_conf(out / r / "mosquitto.conf", ports[r], workdir, tls=tls)
               for r in regions}
    return Tier(core, bridge, started, inventory, workdir / "secrets", out, tls,
                {r: summary["regions"][r]["bridges"] for r in regions})


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Callable[..., Tier]]:
    """``tier(*flags, inventory=INVENTORY, tls=None)``: provisioned (``flags``: more
    ``fleetctl broker-config`` flags), started, bridges connected; stopped after the test.
    Skips without mosquitto."""
    if not have_mosquitto():
        pytest.skip("mosquitto is not installed (make services)")
    started: list[Tier] = []

    def start(*extra: str, inventory: dict[str, dict[str, Any]] | None = None,
              tls: Pki | None = None) -> Tier:
        t = provision(tmp_path / f"tier-{len(started)}", inventory or INVENTORY, *extra,
                      tls=tls)
        started.append(t)
        watch = t.operator("fleet-watch").subscribe("$SYS/broker/connection/+/state")
        try:
            t.wait_bridges(watch)
        finally:
            watch.close()
        return t

    yield start
    for t in started:
        t.stop()
