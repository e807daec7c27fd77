"""``fleetctl broker-config --core``: a bridged tier of mosquitto brokers for a large fleet.

One mosquitto is single-threaded; past ~25k devices the fleet is split over regional brokers,
each bridged to one core broker where the controller and the operator tools connect::

    devices (region eu) -> eu broker --bridge--\\
                                                core broker <- fleetctl (operator listener)
    devices (region us) -> us broker --bridge--/

- A regional broker has the single broker's device listener (per-device accounts and ACL,
  ``use_username_as_clientid``), for the devices of its region only, and no operator listener.
  It is where a device's identity is proven: what it bridges to the core has passed that ACL.
- Its bridge logs in to the core's bridge listener as ``bridge-<region>`` (own password,
  ``SECRETS/bridges/``); the core's ACL lets that account write the bridged-out topics of
  its own region's devices only (a region whose broker or bridge password is taken cannot
  speak for another region's devices) and read the command topics bridged in.
- The core's operator listener is the single broker's (client id = account, see
  ``fleet.broker.config``): no operator account can take a bridge's session (and the
  commands queued there for a whole region) by connecting with its client id.
- Out (region -> core): ``dev/+/status``, ``dev/+/res``, ``dev/+/evt/#`` at QoS 1,
  ``dev/+/telemetry`` at QoS 0. In (core -> region): ``dev/<id>/cmd/#`` for each device of
  the region and ``group/<g>/cmd/#`` for each group with a device there, QoS 1. A command
  crosses to its device's region only, and a group command once to each region that has
  the group: it is one publish at the core.
- A region of more than ``--devices-per-bridge`` devices (default
  :data:`DEVICES_PER_BRIDGE`) has one bridge per that many devices (``bridge-<region>``,
  ``bridge-<region>@1``, ...): each carries its own devices' messages out (their topics one
  by one) and commands in, the first also the region's group commands, and each has an
  account at the core whose ACL lists only its devices (:func:`bridge_acl` says why).
- ``cleansession false`` and a fixed client id on both sides, with ``persistence true``: what
  the core queued for a region that was down, and what a region queued while the core was
  down, is delivered when the bridge reconnects, also across a restart.
- ``bridge_protocol_version mqttv311``: mosquitto 2.0's v5 bridge sends no session expiry
  interval, so the core would drop its session (and the commands queued there) on every
  disconnect (eclipse-mosquitto/mosquitto#2424, #2793). v5 properties do not cross a v3.1.1
  bridge; the fleet's commands and results carry none (telemetry's message expiry is lost,
  which only matters to a queued QoS 0 message: none is).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract import Topics
from fleet.broker.config import (
    RESERVED_PREFIX,
    Accounts,
    BrokerConfigError,
    FleetInventory,
    Listener,
    ServerTls,
    check_disjoint,
    device_acl,
    device_listener_lines,
    global_lines,
    mosquitto_hash,
    operator_accounts,
    operator_acl,
    operator_listener_lines,
    write_private,
)
from registry.atomic import make_dirs

CORE = "core"
"""The core broker's name: its folder under OUT, and a name no region may take."""
BRIDGE_ACCOUNT_PREFIX = "bridge-"
AUTOSAVE_INTERVAL_S = 30
"""How often mosquitto writes its persistence file. A SIGTERM saves everything; a kill -9
loses what changed since the last save (at most this many seconds of queued messages)."""
RESTART_TIMEOUT_S = (2, 30)
"""The bridge's reconnect back-off, base and cap (mosquitto's decorrelated jitter): every
region reconnects within seconds of a core restart, not all in the same second."""


DEVICES_PER_BRIDGE = 1000
"""The most devices one bridge carries. The core checks each bridged message against its
bridge account's rules, one rule per device (:func:`bridge_acl`), one after another, and
loads an account's rules in time quadratic in their number. Measured with mosquitto 2.0.11
(``benchmarks/bridge_acl.py``), a result bridged from a region of 25,000 devices cost the
core 177 us of CPU on one bridge, 16 us on 25 bridges of 1,000, and 8 us with the wildcard
rules of old (which let a region speak for any device)."""
BRIDGE_SHARD_MARK = "@"
"""``bridge-<region>@<n>``: the n-th extra bridge of a region. No region name holds it (ids
are letters, digits, ``.``, ``_``, ``-``), so no two regions' bridges share a name."""


def bridge_account(region: str, index: int = 0) -> str:
    """The account (and connection name, and client id at the core) of ``region``'s bridge
    number ``index``."""
    base = f"{BRIDGE_ACCOUNT_PREFIX}{region}"
    return base if index == 0 else f"{base}{BRIDGE_SHARD_MARK}{index}"


@dataclass(frozen=True)
class Bridge:
    """One bridge of a region: its account and the devices whose messages it carries."""

    account: str
    devices: list[str]
    groups: list[str]
    """The group commands it carries in (the region's first bridge carries them all)."""
    whole_region: bool
    """It is the region's only bridge (its topics out may then be wildcards)."""


@dataclass(frozen=True)
class Region:
    """One regional broker: its device listener and its devices (id -> groups)."""

    name: str
    devices: Listener
    members: FleetInventory

    def groups(self) -> list[str]:
        return sorted({g for d in self.members.devices.values() for g in d.groups})

    def bridges(self, per_bridge: int) -> list[Bridge]:
        """Its bridges, at most ``per_bridge`` devices each (sorted ids, cut in order)."""
        ids = sorted(self.members.devices)
        cuts = [ids[i:i + per_bridge] for i in range(0, len(ids), per_bridge)]
        return [Bridge(bridge_account(self.name, i), cut, self.groups() if i == 0 else [],
                       len(cuts) == 1) for i, cut in enumerate(cuts)]


def out_topics(topics: Topics, bridge: Bridge) -> list[tuple[str, int]]:
    """What ``bridge`` sends to the core: (topic filter, QoS). The region's only bridge
    takes every device topic; one of several takes its own devices' topics, one by one
    (matched in the region's subscription tree, not scanned)."""
    p = topics.prefix
    levels = ["+"] if bridge.whole_region else bridge.devices
    return [(f"{p}/dev/{d}/{kind}", qos) for d in levels
            for kind, qos in (("status", 1), ("res", 1), ("evt/#", 1), ("telemetry", 0))]


def in_topics(topics: Topics, bridge: Bridge) -> list[str]:
    """What the core sends over ``bridge``: its devices' commands and its groups' commands.

    One line per device rather than ``dev/+/cmd/#``: a command then crosses to its device's
    region only (not to every region, each forwarding it to nobody), and a region never sees
    another's commands. The core matches them in its subscription tree (one node per device,
    no per-message scan); each costs one SUBSCRIBE when the bridge connects.
    """
    p = topics.prefix
    return ([f"{p}/dev/{d}/cmd/#" for d in bridge.devices]
            + [f"{p}/group/{g}/cmd/#" for g in bridge.groups])


def split_regions(inv: FleetInventory, listeners: Mapping[str, Listener],
                  default: Listener) -> list[Region]:
    """The inventory's devices by region; every device must have one. ``listeners``
    overrides ``default`` (the device listener) per region and may name only regions that
    have devices."""
    unplaced = sorted(d for d, e in inv.devices.items() if e.region is None)
    if unplaced:
        shown = ", ".join(unplaced[:5]) + (f" and {len(unplaced) - 5} more"
                                           if len(unplaced) > 5 else "")
        raise BrokerConfigError(f"devices.{unplaced[0]}.region: a bridged tier (--core) needs "
                                f"a region for every device; none for {shown}")
    names = sorted({e.region for e in inv.devices.values() if e.region is not None})
    if CORE in names:
        first = next(d for d, e in inv.devices.items() if e.region == CORE)
        raise BrokerConfigError(f"devices.{first}.region: {CORE!r} names the core broker; "
                                "call the region something else")
    unknown = sorted(set(listeners) - set(names))
    if unknown:
        raise BrokerConfigError(f"--region {unknown[0]}: no device of the inventory is in "
                                f"region {unknown[0]!r} (its regions: {', '.join(names)})")
    return [Region(name, listeners.get(name, default), FleetInventory(devices={
        d: e for d, e in inv.devices.items() if e.region == name}))
        for name in names]


# --- the core ------------------------------------------------------------------------------


def bridge_acl(topics: Topics, regions: list[Region], per_bridge: int) -> str:
    """The core's ACL for the bridge accounts: each bridge writes what its own devices may
    write in their region (``dev/<id>/#``, one rule per device) and reads the bridged-in
    command topics.

    The region's ACL has already tied each topic's device id to the device's account; this
    ties the device to its region, so a region whose broker or bridge password is taken cannot
    publish another region's statuses, results, events or telemetry at the core. mosquitto
    checks an account's rules one after another until one matches, and appends each rule it
    loads by walking the account's list: a bridge carries at most ``per_bridge`` devices
    (:data:`DEVICES_PER_BRIDGE`). The reads stay wildcards, first in the list (a command
    delivery costs two checks): a taken bridge password can read other regions' commands
    (names and numbers, no secret), never write them.
    """
    p = topics.prefix
    out = ["# Written by fleetctl broker-config: each bridge writes its own devices' messages",
           "# and reads the commands bridged to them."]
    for r in regions:
        for b in r.bridges(per_bridge):
            out += ["", f"user {b.account}",
                    f"topic read {p}/dev/+/cmd/#", f"topic read {p}/group/+/cmd/#",
                    # the bridge's own connection state (mosquitto's notifications, a will)
                    f"topic write $SYS/broker/connection/{b.account}/state"]
            out += [f"topic write {p}/dev/{d}/#" for d in b.devices]
    return "\n".join(out) + "\n"


def core_conf(out: Path, bridges: Listener, operators: Listener, n_regions: int,
              tls: ServerTls | None) -> str:
    lines = [
        f"# Written by fleetctl broker-config: the core broker of a tier of {n_regions} "
        "regional brokers.",
        "# Start it with mosquitto -c (it sets persistence: do not include it from a conf that",
        "# sets persistence too). The files must be readable by the broker's user:",
        f"#   chown -R mosquitto: {out}",
        *global_lines(),
        *persistence_lines(out),
        "",
        "# Regional brokers' bridges: an account each, client id = account (a bridge's queued",
        "# commands live in its session; nothing else may take that id).",
        bridges.line(),
        "allow_anonymous false",
        "use_username_as_clientid true",
        f"password_file {out / 'passwd-bridges'}",
        f"acl_file {out / 'acl-bridges'}",
        *(tls.lines(devices=False) if tls else []),
        "",
        *operator_listener_lines(out, operators, tls),
    ]
    return "\n".join(lines) + "\n"


def persistence_lines(out: Path) -> list[str]:
    return ["# Queued messages and sessions (the bridges' included) survive a restart.",
            "persistence true", f"persistence_location {out / 'data'}/",
            f"autosave_interval {AUTOSAVE_INTERVAL_S}"]


# --- a region ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoreAddress:
    """Where the regions' bridges dial the core (its bridge listener as they reach it)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> CoreAddress:
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(
                c.isspace() for c in host):
            raise BrokerConfigError(f"--core: {text!r} is not HOST:PORT (the core's bridge "
                                    "listener as the regional brokers reach it)")
        return cls(host.strip("[]"), int(port))


def bridge_lines(topics: Topics, region: Region, bridge: Bridge, core: CoreAddress,
                 password: str, tls: ServerTls | None) -> list[str]:
    acct = bridge.account
    lines = [
        f"# A bridge to the core: {len(bridge.devices)} devices' messages out, their commands"
        + (" and the region's group commands in." if bridge.groups else " in."),
        f"connection {acct}",
        f"address {core.host}:{core.port}",
        "# v5 bridges send no session expiry: the core would drop the session on disconnect.",
        "bridge_protocol_version mqttv311",
        f"remote_clientid {acct}",
        f"remote_username {acct}",
        f"remote_password {password}",
        # a device id cannot start with fleetctl-, so no device can take this client id
        f"local_clientid {RESERVED_PREFIX}{acct}",
        "cleansession false",
        "local_cleansession false",
        f"restart_timeout {RESTART_TIMEOUT_S[0]} {RESTART_TIMEOUT_S[1]}",
    ]
    if tls is not None:
        lines += [f"bridge_cafile {tls.cafile.resolve()}", "bridge_tls_version tlsv1.2"]
    lines += [f"topic {t} out {qos}" for t, qos in out_topics(topics, bridge)]
    lines += [f"topic {t} in 1" for t in in_topics(topics, bridge)]
    return lines


def region_conf(out: Path, topics: Topics, region: Region, per_bridge: int, core: CoreAddress,
                password: str, tls: ServerTls | None) -> str:
    bridges = region.bridges(per_bridge)
    lines = [
        f"# Written by fleetctl broker-config: region {region.name!r} of a bridged tier, "
        f"{len(region.members.devices)} devices, {len(bridges)} bridge(s) to the core.",
        "# Start it with mosquitto -c (it sets persistence: do not include it from a conf that",
        "# sets persistence too). It holds the bridge's password: keep it 0600, readable only",
        "# by the broker's user:",
        f"#   chown -R mosquitto: {out}",
        *global_lines(),
        *persistence_lines(out),
        "",
        *device_listener_lines(out, region.devices, tls),
    ]
    for b in bridges:
        lines += ["", *bridge_lines(topics, region, b, core, password, tls)]
    return "\n".join(lines) + "\n"


def broker_tls(tls: ServerTls | None, broker: str) -> ServerTls | None:
    """``{broker}`` in the certificate and key paths becomes the broker's name (``core`` or
    the region's): each broker serves its own certificate, for its own host name."""
    if tls is None:
        return None
    return ServerTls(tls.cafile, Path(str(tls.certfile).replace("{broker}", broker)),
                     Path(str(tls.keyfile).replace("{broker}", broker)),
                     tls.require_certificate)


# --- all of it -----------------------------------------------------------------------------


def write_broker_tier(
    inv: FleetInventory,
    out: Path,
    secrets_dir: Path,
    *,
    topics: Topics,
    core: CoreAddress,
    bridges: Listener,
    operators: Listener,
    devices: Listener,
    region_listeners: Mapping[str, Listener] | None = None,
    tls: ServerTls | None = None,
    operator_extra: dict[str, str] | None = None,
    per_bridge: int = DEVICES_PER_BRIDGE,
) -> dict[str, Any]:
    """Write ``OUT/core/`` (bridge and operator listeners) and ``OUT/<region>/`` (device
    listener and bridges) for each region of the inventory; returns a summary.
    ``operator_extra``: more operator accounts at the core, name -> role; ``per_bridge``: the
    most devices one bridge carries (:data:`DEVICES_PER_BRIDGE`)."""
    if per_bridge < 1:
        raise BrokerConfigError(f"--devices-per-bridge {per_bridge}: at least 1")
    if bridges.port == operators.port:
        raise BrokerConfigError(f"the core's bridge and operator listeners share port "
                                f"{bridges.port}; give them two")
    if any(c.isspace() for c in topics.prefix):
        raise BrokerConfigError(f"prefix {topics.prefix!r}: ACL files cannot hold whitespace")
    regions = split_regions(inv, region_listeners or {}, devices)
    ops = operator_accounts(operator_extra)
    bridge_names = {b.account: r for r in regions for b in r.bridges(per_bridge)}
    check_disjoint(inv, ops, {a: f"region {r.name}'s bridge account"
                              for a, r in bridge_names.items()})
    out = out.resolve()
    accounts = Accounts(secrets_dir)
    mtls = tls is not None and tls.require_certificate
    trees: dict[str, dict[str, str]] = {CORE: {
        "acl-bridges": bridge_acl(topics, regions, per_bridge),
        # mosquitto's bridge notifications: 1 while region <r> is connected, 0 when not
        "acl-operators": operator_acl(topics, ops, {"fleet-watch": [
            "topic read $SYS/broker/connection/+/state"]}),
        "passwd-operators": accounts.passwd("operators", list(ops)),
        # one password per region, its bridges' accounts hashing it each
        "passwd-bridges": "".join(
            f"{a}:{mosquitto_hash(accounts.password('bridges', bridge_account(r.name)))}\n"
            for a, r in bridge_names.items()),
    }}
    trees[CORE]["mosquitto.conf"] = core_conf(out / CORE, bridges, operators, len(regions),
                                              broker_tls(tls, CORE))
    for r in regions:
        files = {"acl-devices": device_acl(r.members, topics)}
        if not mtls:
            files["passwd-devices"] = accounts.passwd("devices", sorted(r.members.devices))
        pw = accounts.password("bridges", bridge_account(r.name))
        files["mosquitto.conf"] = region_conf(out / r.name, topics, r, per_bridge, core, pw,
                                              broker_tls(tls, r.name))
        trees[r.name] = files
    for name, files in trees.items():
        make_dirs(out / name / "data")
        for fname, text in files.items():  # the conf last: it names the others
            write_private(out / name / fname, text)
    return {
        "core": {"conf": str(out / CORE / "mosquitto.conf"),
                 "bridge_listener": f"{bridges.bind}:{bridges.port}",
                 "operator_listener": f"{operators.bind}:{operators.port}",
                 "operators": accounts.operators_summary(ops)},
        "regions": {r.name: {"conf": str(out / r.name / "mosquitto.conf"),
                             "devices": len(r.members.devices),
                             "device_listener": f"{r.devices.bind}:{r.devices.port}",
                             "bridge_account": bridge_account(r.name),
                             "bridges": [b.account for b in r.bridges(per_bridge)],
                             "bridges_to": f"{core.host}:{core.port}"} for r in regions},
        "device_auth": "certificate CN" if mtls else "password",
        "device_passwords": None if mtls else str(accounts.root / "devices"),
        "generated": accounts.generated,
    }
