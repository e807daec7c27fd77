"""``fleetctl broker-config``: mosquitto's listeners, accounts and ACLs for an inventory of
devices (the work is ``fleet.broker_config``; here are its flags, its help text and the check
that the TLS files come together).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from contract import Topics
from fleet.broker_config import (
    BrokerConfigError,
    Listener,
    ServerTls,
    load_inventory,
    write_broker_config,
)
from fleet.cli_options import EXIT_OK, UsageError


def cmd_broker_config(a: argparse.Namespace) -> int:
    tls = None
    if a.cafile or a.certfile or a.keyfile:
        if not (a.cafile and a.certfile and a.keyfile):
            raise UsageError("broker-config: --cafile, --certfile and --keyfile go together")
        tls = ServerTls(a.cafile, a.certfile, a.keyfile, a.require_certificate)
    elif a.require_certificate:
        raise UsageError("broker-config: --require-certificate needs --cafile, --certfile, "
                         "--keyfile")
    try:
        summary = write_broker_config(
            load_inventory(a.inventory), a.out, a.secrets, topics=Topics(a.prefix),
            devices=Listener.parse(a.device_listener, "--device-listener"),
            operators=Listener.parse(a.operator_listener, "--operator-listener"), tls=tls,
        )
    except (BrokerConfigError, ValueError) as e:
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

Device <id> logs in as <id> on the device listener, where mosquitto replaces every client id
with the account name (use_username_as_clientid): no device can take another's id, kick it
off or wipe its queued commands. It may write only PREFIX/dev/<id>/# and read only its own
commands and those of its groups. Operator tools log in on the operator listener, one account
each: fleet-controller (controller, rollout create), fleet-send (send), fleet-watch (devices,
watch; read only). Packets over 64 KiB + 4 KiB of headers are refused; anonymous clients too.

Passwords: SECRETS/devices/<id>.password and SECRETS/operators/<account>.password are used
when present (0600, 16+ characters), else generated there (0600); a re-run keeps them. Copy a
device's file to its /etc/edge-agent/mqtt.password (mqtt.password_file in agent.yaml). Every
file under OUT is written atomically, 0600: chown them to the broker's user.
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
    p.add_argument("--require-certificate", action="store_true",
                   help="devices log in with a client certificate whose CN is their id "
                        "(mutual TLS) instead of a password")
    p.set_defaults(fn=cmd_broker_config)
