"""``fleetctl broker-config``: mosquitto's listeners, accounts and ACLs for an inventory of
devices, for one broker or (``--core``) a bridged tier of regional brokers and a core (the
work is ``fleet.broker.config`` and ``fleet.broker.bridge``; here are its flags, its help text
and the checks that options come together).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from contract import Topics
from fleet.broker.bridge import DEVICES_PER_BRIDGE, CoreAddress, write_broker_tier
from fleet.broker.config import (
    BrokerConfigError,
    FleetInventory,
    Listener,
    ServerTls,
    load_inventory,
    write_broker_config,
)
from fleet.cli.options import EXIT_OK, UsageError


def _operators(a: argparse.Namespace) -> dict[str, str]:
    """``--operator NAME=ROLE`` flags: account -> role (checked by operator_accounts)."""
    extra: dict[str, str] = {}
    for spec in a.operator:
        name, eq, role = spec.partition("=")
        if not eq or not name or not role:
            raise BrokerConfigError(f"--operator {spec!r}: NAME=ROLE expected")
        if name in extra:
            raise BrokerConfigError(f"--operator {name}: given twice")
        extra[name] = role
    return extra


def _tier(a: argparse.Namespace, inv: FleetInventory, tls: ServerTls | None) -> dict[str, Any]:
    core = CoreAddress.parse(a.core)
    regions: dict[str, Listener] = {}
    for spec in a.region:
        name, eq, listener = spec.partition("=")
        if not eq or not name:
            raise BrokerConfigError(f"--region {spec!r}: NAME=[ADDRESS:]PORT expected")
        if name in regions:
            raise BrokerConfigError(f"--region {name}: given twice")
        regions[name] = Listener.parse(listener, f"--region {name}")
    bridges = Listener.parse(a.bridge_listener or str(core.port), "--bridge-listener")
    return write_broker_tier(
        inv, a.out, a.secrets, topics=Topics(a.prefix), core=core, bridges=bridges,
        operators=Listener.parse(a.operator_listener, "--operator-listener"),
        devices=Listener.parse(a.device_listener, "--device-listener"),
        region_listeners=regions, tls=tls, operator_extra=_operators(a),
        per_bridge=a.devices_per_bridge,
    )


def cmd_broker_config(a: argparse.Namespace) -> int:
    tls = None
    if a.cafile or a.certfile or a.keyfile:
        if not (a.cafile and a.certfile and a.keyfile):
            raise UsageError("broker-config: --cafile, --certfile and --keyfile go together")
        tls = ServerTls(a.cafile, a.certfile, a.keyfile, a.require_certificate)
    elif a.require_certificate:
        raise UsageError("broker-config: --require-certificate needs --cafile, --certfile, "
                         "--keyfile")
    if a.core is None and (a.region or a.bridge_listener or a.devices_per_bridge is not None):
        raise UsageError("broker-config: --region, --bridge-listener and --devices-per-bridge "
                         "need --core (a bridged tier)")
    if a.devices_per_bridge is None:
        a.devices_per_bridge = DEVICES_PER_BRIDGE
    try:
        inv = load_inventory(a.inventory)
        if a.core is not None:
            summary = _tier(a, inv, tls)
        else:
            placed = sorted(d for d, e in inv.devices.items() if e.region is not None)
            if placed:
                raise BrokerConfigError(
                    f"{a.inventory}: devices.{placed[0]}.region: the inventory places devices "
                    "in regions; give --core to write a bridged tier, or drop the regions")
            summary = write_broker_config(
                inv, a.out, a.secrets, topics=Topics(a.prefix),
                devices=Listener.parse(a.device_listener, "--device-listener"),
                operators=Listener.parse(a.operator_listener, "--operator-listener"), tls=tls,
                operator_extra=_operators(a),
            )
    except (BrokerConfigError, ValueError) as e:
        if str(e).startswith("devices."):  # a field of the inventory: say which file
            raise UsageError(f"broker-config: {a.inventory}: {e}") from None
        raise UsageError(f"broker-config: {e}") from None
    print(json.dumps(summary, indent=1))
    return EXIT_OK


_BROKER_CONFIG_HELP = """\
Write mosquitto's listeners, password files and ACLs for an inventory of devices, so the
broker proves who sent each message (the fleet believes the device id in the topic, never
the payload's).

  devices:                              # INVENTORY (YAML)
    jetson-001: {groups: [line-3, canary]}
    jetson-002: {groups: [line-3]}

Device <id> logs in as <id> on the device listener. It may write only PREFIX/dev/<id>/# and
read only its own commands and those of its groups. Operator tools log in on the operator
listener with an account per role: fleet-controller (controller, rollout create), fleet-send
(send), fleet-watch (devices, watch; read only). On every listener mosquitto replaces each
client id with the account's name (use_username_as_clientid): no account can take another's
id, kick it off or wipe its queued commands or results. So one live connection per account:
give a tool that runs beside another of its role an account of its own with --operator
NAME=ROLE (controller replicas, a dashboard beside fleetctl watch); a second login with an
account replaces the first. Packets over 64 KiB + 4 KiB of headers are refused; anonymous
clients too.

Passwords: SECRETS/devices/<id>.password and SECRETS/operators/<account>.password are used
when present (0600, 16+ characters), else generated there (0600); a re-run keeps them. Copy a
device's file to its /etc/edge-agent/mqtt.password (mqtt.password_file in agent.yaml). Every
file under OUT is written atomically, 0600: chown them to the broker's user.

Bridged tier (--core HOST:PORT), for fleets one broker cannot hold: give each device a region
(jetson-001: {groups: [line-3], region: eu}) and it writes OUT/<region>/ for every region (the
device listener above, for that region's devices, and a bridge to the core) and OUT/core/ (a
bridge listener, one account bridge-<region> each, password SECRETS/bridges/, and the
operator listener; fleetctl connects there). A region's bridge account may write only its own
devices' topics at the core; a region of more than --devices-per-bridge devices gets a bridge
(bridge-<region>@1, ...) per that many. Bridged out at QoS 1: PREFIX/dev/+/status, res, evt/#
(telemetry at QoS 0); in: each region's devices' and groups' commands, so a command
crosses to its device's region only and a group command is one publish at the core. Bridges
keep their sessions (cleansession false, fixed client ids, persistence in OUT/*/data/): what
was queued while a broker was down arrives when it is back. --certfile/--keyfile may contain
{broker} (core or a region's name): each broker serves its own certificate.
"""

_BROKER_CONFIG_EXAMPLE = """\
example:
  fleetctl broker-config --inventory fleet.yaml --out /etc/mosquitto/edgetrain \\
      --secrets /root/edgetrain-secrets --device-listener 8883 \\
      --cafile ca.crt --certfile broker.crt --keyfile broker.key
  chown mosquitto: /etc/mosquitto/edgetrain/*
  mosquitto -c /etc/mosquitto/edgetrain/mosquitto.conf
  fleetctl --port 1884 --tls-ca ca.crt --username fleet-send \\
      --password-file /root/edgetrain-secrets/operators/fleet-send.password \\
      send --group line-3 ping --wait

example, bridged tier on one host (devices with region: eu or region: us; on three hosts,
give --core the core's name and add --cafile ca.crt --certfile 'certs/{broker}.crt'
--keyfile 'certs/{broker}.key'):
  fleetctl broker-config --inventory fleet.yaml --out tier --secrets secrets \\
      --core 127.0.0.1:8884 --region eu=1883 --region us=1885
  chown -R mosquitto: tier
  for b in core eu us; do mosquitto -d -c tier/$b/mosquitto.conf; done
  fleetctl --port 1884 --username fleet-send \\
      --password-file secrets/operators/fleet-send.password send --group line-3 ping --wait
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker-config", help="mosquitto accounts and ACLs for an inventory",
                       description=_BROKER_CONFIG_HELP, epilog=_BROKER_CONFIG_EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inventory", type=Path, required=True, metavar="YAML",
                   help="devices and their groups (format above)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where mosquitto.conf, passwd-* and acl-* go (paths in the conf are "
                        "absolute: write them where the broker reads them)")
    p.add_argument("--secrets", type=Path, required=True, metavar="DIR",
                   help="plain-text passwords, read or generated (keep it off the broker)")
    p.add_argument("--device-listener", default="1883", metavar="[ADDRESS:]PORT",
                   help="where devices connect (default: port 1883 on every interface)")
    p.add_argument("--operator-listener", default="127.0.0.1:1884", metavar="[ADDRESS:]PORT",
                   help="where fleetctl connects (default: 127.0.0.1:1884)")
    p.add_argument("--cafile", type=Path, help="TLS on both listeners: the CA of client "
                   "certificates (with --require-certificate)")
    p.add_argument("--certfile", type=Path, help="the broker's certificate")
    p.add_argument("--keyfile", type=Path, help="the broker's key")
    p.add_argument("--core", metavar="HOST:PORT",
                   help="write a bridged tier: OUT/core/ and OUT/<region>/ per region of the "
                        "inventory; HOST:PORT is the core's bridge listener as the regional "
                        "brokers reach it")
    p.add_argument("--bridge-listener", metavar="[ADDRESS:]PORT",
                   help="where the core takes the regions' bridges (default: the port of "
                        "--core on every interface)")
    p.add_argument("--devices-per-bridge", type=int, metavar="N",
                   help="the most devices one bridge carries: a larger region gets a bridge "
                        f"(and an account at the core) per N devices (default "
                        f"{DEVICES_PER_BRIDGE}: the core checks a bridged message against "
                        "one rule per device of its bridge)")
    p.add_argument("--region", action="append", default=[], metavar="NAME=[ADDRESS:]PORT",
                   help="a region's device listener, if not --device-listener (repeatable; "
                        "only regions the inventory names)")
    p.add_argument("--operator", action="append", default=[], metavar="NAME=ROLE",
                   help="another operator account with ROLE's ACL (fleet-controller, "
                        "fleet-send or fleet-watch), password SECRETS/operators/NAME.password; "
                        "repeatable: one per tool that runs beside another of its role")
    p.add_argument("--require-certificate", action="store_true",
                   help="devices log in with a client certificate whose CN is their id "
                        "(mutual TLS) instead of a password")
    p.set_defaults(fn=cmd_broker_config)
