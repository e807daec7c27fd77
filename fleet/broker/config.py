"""``fleetctl broker-config``: mosquitto's accounts, passwords and ACLs for an inventory.

The broker is where a device's identity is proven: the fleet believes the device id in a
message's topic (fleet.mqtt.device_message) only because the ACL written here lets each
device account write nothing but its own ``{prefix}/dev/{id}/#``. What it writes, for
mosquitto 2.0 (Debian 12 ships 2.0.11):

- ``per_listener_settings true`` and two listeners, each with its own password file and ACL.
- Client ids are broker-wide: whoever connects with a session's id takes the session over
  (kicks its owner off; with a clean start, wipes the commands or results queued there).
  So EVERY listener sets ``use_username_as_clientid true``: a connection's client id is its
  account, whatever id it sent. Device and operator accounts are disjoint names, so no account
  can take another's session, on either listener.
- Stock mosquitto 2.0 binds an id to an account one to one only (``use_username_as_clientid``,
  or the dynamic-security plugin's exact ``clientid``; ``clientid_prefixes`` is one global
  prefix checked before the id is replaced): one live connection per account. A second login
  with an account replaces the first. Operator tools that run side by side (controller
  replicas, a dashboard beside ``fleetctl watch``) each get an account of their own:
  ``--operator NAME=ROLE`` adds one with the role's ACL.
- Device ``<id>`` writes ``{prefix}/dev/<id>/#``, reads ``{prefix}/dev/<id>/cmd/#`` and the
  command topics of exactly its own groups.
- Operator accounts, one per role at least (see :data:`OPERATORS`), each with only the topics
  its role needs.
- ``max_packet_size`` (the contract's 64 KiB payload plus headers): the broker drops a larger
  packet and its sender before any device buffers it.

Passwords come from ``SECRETS/{devices,operators}/<name>.password`` when the operator put one
there (0600, 16+ characters), else are generated and written there (0600): a re-run after
adding a device keeps every other device's password.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from contract import MAX_PAYLOAD_BYTES, Topics, check_id
from registry.atomic import make_dirs, write_bytes_atomic

MAX_PACKET_BYTES = MAX_PAYLOAD_BYTES + 4096
"""The largest MQTT packet the broker takes: a 64 KiB payload plus its fixed header, topic
(ids are <= 64 characters) and v5 properties (response topic, correlation data)."""
MAX_QUEUED_MESSAGES = 100_000
"""Per client. The controller's session collects every device's results while it is down;
mosquitto's default of 1000 silently drops the rest."""
PBKDF2_ITERATIONS = 101
"""mosquitto_passwd's own default in 2.0. Each CONNECT costs the (single-threaded) broker one
hash, and generated passwords carry 192 random bits, so more iterations would buy nothing."""
MIN_PASSWORD_CHARS = 16
RESERVED_PREFIX = "fleetctl-"
"""The client ids fleetctl writes into a broker's own configuration start with this (a
regional broker's local bridge client, fleet/broker/bridge.py): no device or operator account
may be named so, or it could take that session over."""

OPERATORS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "fleet-controller": ("fleetctl controller, fleetctl rollout create", [
        ("read", "dev/+/status"), ("read", "dev/+/res"), ("write", "dev/+/cmd/#"),
    ]),
    "fleet-send": ("fleetctl send", [
        ("read", "dev/+/status"), ("read", "dev/+/res"), ("write", "dev/+/cmd/#"),
        ("write", "group/+/cmd/#"),
    ]),
    "fleet-watch": ("fleetctl devices, fleetctl watch, live views (read only)", [
        ("read", "dev/+/status"), ("read", "dev/+/telemetry"), ("read", "dev/+/evt/#"),
        ("read", "dev/+/res"),
    ]),
}
"""Operator role -> (the tools that use it, its ACL as (access, topic under the prefix)).
Each role has an account named after it; ``--operator NAME=ROLE`` adds more."""


class BrokerConfigError(ValueError):
    """Bad inventory, listener or secret; the message names the file or field."""


def operator_accounts(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Operator account -> role: one account per role, named after it, then ``extra``
    (``--operator NAME=ROLE``: another account with that role's ACL, for a tool that runs
    beside another of its role: one live connection per account)."""
    accounts = {role: role for role in OPERATORS}
    for name, role in (extra or {}).items():
        where = f"--operator {name}={role}"
        if role not in OPERATORS:
            raise BrokerConfigError(f"{where}: no role {role!r}; one of {', '.join(OPERATORS)}")
        try:
            check_id(name, "operator account")
        except ValueError as e:
            raise BrokerConfigError(f"{where}: {e}") from None
        if name in accounts:
            raise BrokerConfigError(f"{where}: account {name!r} exists already (every role "
                                    "has an account named after it)")
        if name.startswith(RESERVED_PREFIX):
            raise BrokerConfigError(f"{where}: {RESERVED_PREFIX!r} is reserved for the client "
                                    "ids fleetctl writes into the broker's conf")
        accounts[name] = role
    return accounts


def check_disjoint(inv: FleetInventory, accounts: dict[str, str],
                   others: dict[str, str] | None = None) -> None:
    """No two accounts of one broker share a name: client ids are the account names and
    broker-wide, so the two would take each other's sessions over. ``others``: more account
    names (a core's bridges) -> what they are."""
    for name in accounts:
        if name in inv.devices:
            raise BrokerConfigError(
                f"devices.{name}: {name!r} is also an operator account; client ids are account "
                "names and broker-wide, so the two would kick each other off: rename the "
                "device" + ("" if name in OPERATORS else " or the --operator account"))
        if name in (others or {}):
            raise BrokerConfigError(f"--operator {name}: the name of {others[name]}; pick "
                                    "another (client ids are account names and broker-wide)")


class InventoryDevice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[str] = Field(default_factory=list)
    """The groups whose commands this device may read (``send --group``)."""
    region: str | None = None
    """The regional broker the device connects to, in a bridged tier (``--core``); a single
    broker takes no regions."""

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        return sorted({check_id(g, "group") for g in v})

    @field_validator("region")
    @classmethod
    def _region(cls, v: str | None) -> str | None:
        return None if v is None else check_id(v, "region")


class FleetInventory(BaseModel):
    """The operator's list of devices: what the broker lets each one do.

    ``devices: {jetson-001: {groups: [line-3, canary]}, jetson-002: {groups: [line-3]}}``
    """

    model_config = ConfigDict(extra="forbid")

    devices: dict[str, InventoryDevice] = Field(min_length=1)
    """Device id (its broker account and topic level) -> its groups."""

    @field_validator("devices")
    @classmethod
    def _ids(cls, v: dict[str, InventoryDevice]) -> dict[str, InventoryDevice]:
        for d in v:
            check_id(d)
            if d.startswith(RESERVED_PREFIX):
                raise ValueError(f"device id {d!r}: {RESERVED_PREFIX!r} is reserved for "
                                 "fleetctl's client ids")
        return v


def load_inventory(path: Path) -> FleetInventory:
    try:
        # libyaml's loader where PyYAML has it: 5x faster on a 10,000-device inventory.
        data = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                                yaml.SafeLoader))
    except (OSError, yaml.YAMLError) as e:
        raise BrokerConfigError(f"{path}: cannot read the inventory: {e}") from None
    try:
        return FleetInventory.model_validate(data)
    except ValidationError as e:
        lines = [f"{path}: {e.error_count()} error(s)"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(inventory)"
            lines.append(f"  {loc}: {err['msg'].removeprefix('Value error, ')}")
        raise BrokerConfigError("\n".join(lines)) from None


@dataclass(frozen=True)
class Listener:
    port: int
    bind: str

    @classmethod
    def parse(cls, text: str, what: str) -> Listener:
        """``PORT`` (every interface) or ``ADDRESS:PORT``."""
        host, _, port = text.rpartition(":")
        try:
            p = int(port)
        except ValueError:
            p = 0
        if not 0 < p < 65536 or any(c.isspace() for c in host):
            raise BrokerConfigError(f"{what}: {text!r} is not PORT or ADDRESS:PORT")
        return cls(p, host.strip("[]") or "0.0.0.0")

    def line(self) -> str:
        return f"listener {self.port} {self.bind}"


@dataclass(frozen=True)
class ServerTls:
    """The broker's certificate on both listeners; ``require_certificate``: devices log in
    with a client certificate whose CN is their id (mutual TLS) instead of a password."""

    cafile: Path
    certfile: Path
    keyfile: Path
    require_certificate: bool = False

    def lines(self, devices: bool) -> list[str]:
        out = [f"cafile {self.cafile.resolve()}", f"certfile {self.certfile.resolve()}",
               f"keyfile {self.keyfile.resolve()}", "tls_version tlsv1.2"]
        if devices and self.require_certificate:
            out += ["require_certificate true", "use_identity_as_username true"]
        return out


# --- passwords -----------------------------------------------------------------------------


def mosquitto_hash(password: str, salt: bytes | None = None) -> str:
    """mosquitto 2's password file hash (``$7$``: PBKDF2-HMAC-SHA512, 12-byte salt).

    Written here rather than by ``mosquitto_passwd``, which takes a password per run on its
    command line (seen by ps) or hashes a plain-text file in place: this way no plain text
    touches the broker's files, the file is written atomically, and the operator's machine
    needs no mosquitto. The tests check the broker accepts it.
    """
    salt = salt if salt is not None else os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    b64 = base64.b64encode
    return f"$7${PBKDF2_ITERATIONS}${b64(salt).decode()}${b64(digest).decode()}"


def write_private(path: Path, text: str) -> None:
    """Atomically, and 0600 from the first byte (never briefly readable under the umask)."""
    make_dirs(path.parent)
    write_bytes_atomic(path, text.encode())


def account_password(path: Path) -> tuple[str, bool]:
    """(password, generated): the operator's, read from ``path``, or a new one written there."""
    if not path.exists():
        pw = secrets.token_urlsafe(24)
        write_private(path, pw + "\n")
        return pw, True
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise BrokerConfigError(f"{path}: mode {mode:04o} lets others read a password; "
                                f"chmod 600 {path}")
    lines = path.read_text().splitlines()
    pw = lines[0].strip() if lines else ""
    if len(pw) < MIN_PASSWORD_CHARS or any(line.strip() for line in lines[1:]):
        raise BrokerConfigError(f"{path}: one line of at least {MIN_PASSWORD_CHARS} "
                                "characters expected (delete it to have one generated)")
    return pw, False


class Accounts:
    """The plain-text passwords under ``root`` (``{kind}/{name}.password``), read or
    generated, and the mosquitto password files made from them."""

    def __init__(self, root: Path) -> None:
        self.root = make_dirs(root.resolve())
        self.generated: list[str] = []
        """``kind/name`` of each password generated by this run."""

    def path(self, kind: str, name: str) -> Path:
        return self.root / kind / f"{name}.password"

    def password(self, kind: str, name: str) -> str:
        pw, new = account_password(self.path(kind, name))
        if new:
            self.generated.append(f"{kind}/{name}")
        return pw

    def passwd(self, kind: str, names: list[str]) -> str:
        """A mosquitto password file for these accounts."""
        return "\n".join(f"{n}:{mosquitto_hash(self.password(kind, n))}" for n in names) + "\n"

    def operators_summary(self, accounts: dict[str, str]) -> dict[str, dict[str, str]]:
        return {u: {"password_file": str(self.path("operators", u)), "role": role,
                    "for": OPERATORS[role][0]} for u, role in accounts.items()}


# --- the files -----------------------------------------------------------------------------


def device_acl(inv: FleetInventory, topics: Topics) -> str:
    p = topics.prefix
    out = ["# Written by fleetctl broker-config: each device writes only its own subtree and",
           "# reads only its own and its groups' commands."]
    for dev, entry in sorted(inv.devices.items()):
        out += ["", f"user {dev}", f"topic write {p}/dev/{dev}/#",
                f"topic read {p}/dev/{dev}/cmd/#"]
        out += [f"topic read {p}/group/{g}/cmd/#" for g in entry.groups]
    return "\n".join(out) + "\n"


def operator_acl(topics: Topics, accounts: dict[str, str],
                 extra: dict[str, list[str]] | None = None) -> str:
    """``accounts``: account -> role (:func:`operator_accounts`); ``extra``: role -> more ACL
    lines (a bridged tier's core adds some)."""
    out = ["# Written by fleetctl broker-config: operator accounts, each with its role's topics."]
    for user, role in accounts.items():
        tools, rules = OPERATORS[role]
        out += ["", f"# {role}: {tools}", f"user {user}"]
        out += [f"topic {access} {topics.prefix}/{t}" for access, t in rules]
        out += (extra or {}).get(role, [])
    return "\n".join(out) + "\n"


def global_lines() -> list[str]:
    """Settings every broker fleetctl writes has, before any listener."""
    return [
        "per_listener_settings true",
        f"max_packet_size {MAX_PACKET_BYTES}",
        f"max_queued_messages {MAX_QUEUED_MESSAGES}",
        "# QoS 1 round trips wait ~40 ms on Nagle + delayed ACK without it.",
        "set_tcp_nodelay true",
    ]


def device_listener_lines(out: Path, devices: Listener, tls: ServerTls | None) -> list[str]:
    """The device listener: per-device accounts (or certificate CNs) and the device ACL."""
    lines = [
        "# Devices: the client id is replaced by the account's name, so no device can take",
        "# another's id (and with it its connection and its queued commands).",
        devices.line(),
        "allow_anonymous false",
        "use_username_as_clientid true",
    ]
    if not (tls is not None and tls.require_certificate):
        lines.append(f"password_file {out / 'passwd-devices'}")
    lines.append(f"acl_file {out / 'acl-devices'}")
    return lines + (tls.lines(devices=True) if tls else [])


def operator_listener_lines(out: Path, operators: Listener, tls: ServerTls | None) -> list[str]:
    lines = [
        "# Operator tools (fleetctl): the client id is replaced by the account's name too, so",
        "# no operator account can take a device's, a bridge's or another account's session.",
        "# One live connection per account: a tool that runs beside another of its role needs",
        "# an account of its own (fleetctl broker-config --operator NAME=ROLE).",
        operators.line(),
        "allow_anonymous false",
        "use_username_as_clientid true",
        f"password_file {out / 'passwd-operators'}",
        f"acl_file {out / 'acl-operators'}",
    ]
    return lines + (tls.lines(devices=False) if tls else [])


def mosquitto_conf(out: Path, devices: Listener, operators: Listener, n_devices: int,
                   tls: ServerTls | None) -> str:
    lines = [
        f"# Written by fleetctl broker-config for {n_devices} devices. Use it as mosquitto's",
        "# conf (mosquitto -c) or include it from one that sets no security option of its own",
        "# (Debian: copy it to /etc/mosquitto/conf.d/). kill -HUP reloads passwords and ACLs.",
        "# The password and ACL files must be readable by the broker's user:",
        f"#   chown mosquitto: {out}/passwd-* {out}/acl-*",
        *global_lines(),
        "",
        *device_listener_lines(out, devices, tls),
        "",
        *operator_listener_lines(out, operators, tls),
    ]
    return "\n".join(lines) + "\n"


def write_broker_config(
    inv: FleetInventory,
    out: Path,
    secrets_dir: Path,
    *,
    topics: Topics,
    devices: Listener,
    operators: Listener,
    tls: ServerTls | None = None,
    operator_extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write mosquitto.conf, passwd-{devices,operators} and acl-{devices,operators} under
    ``out`` (each atomically, 0600); returns a summary for the operator. ``operator_extra``:
    more operator accounts, name -> role (:func:`operator_accounts`)."""
    if devices.port == operators.port:
        raise BrokerConfigError(f"the device and operator listeners share port {devices.port}; "
                                "give them two")
    if any(c.isspace() for c in topics.prefix):
        raise BrokerConfigError(f"prefix {topics.prefix!r}: ACL files cannot hold whitespace")
    ops = operator_accounts(operator_extra)
    check_disjoint(inv, ops)
    out = out.resolve()
    accounts = Accounts(secrets_dir)
    mtls = tls is not None and tls.require_certificate
    files = {
        "acl-devices": device_acl(inv, topics),
        "acl-operators": operator_acl(topics, ops),
        "passwd-operators": accounts.passwd("operators", list(ops)),
    }
    if not mtls:
        files["passwd-devices"] = accounts.passwd("devices", sorted(inv.devices))
    files["mosquitto.conf"] = mosquitto_conf(out, devices, operators, len(inv.devices), tls)
    make_dirs(out)
    for name, text in files.items():  # the conf last: it names the others
        write_private(out / name, text)
    return {
        "conf": str(out / "mosquitto.conf"),
        "devices": len(inv.devices),
        "device_listener": f"{devices.bind}:{devices.port}",
        "device_auth": "certificate CN" if mtls else "password",
        "operator_listener": f"{operators.bind}:{operators.port}",
        "operators": accounts.operators_summary(ops),
        "device_passwords": None if mtls else str(accounts.root / "devices"),
        "generated": accounts.generated,
    }
