"""The fleet's devices, discovered from their retained status messages.

Group membership is the operator's, not the device's: given the inventory that
``fleetctl broker-config`` provisioned the broker from (``membership``), a device belongs to
the groups listed there whatever its status claims, and a device not listed there is not in
the fleet. Without it (a broker provisioned by other means) the groups a status names are all
there is, and the broker's ACL is what keeps a device from reading other groups' commands.

Status carries ``conn_seq``, which grows with each connection: a status with a lower
``conn_seq`` than the one we hold (a late last will of an older connection) is ignored, so a
device that reconnected is never shown offline by its previous session's will.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from contract import Status, Telemetry
from fleet.mqtt import FleetConnection

log = logging.getLogger("fleet.inventory")


class Inventory:
    def __init__(self, membership: Mapping[str, list[str]] | None = None) -> None:
        """``membership``: device -> groups from the operator's inventory; None: believe the
        groups each status names."""
        self.devices: dict[str, Status] = {}
        self.telemetry: dict[str, Telemetry] = {}
        self.membership = dict(membership) if membership is not None else None
        self.last_change = time.monotonic()
        self._unlisted: set[str] = set()

    def listed(self, device: str) -> bool:
        """Is ``device`` in the fleet (always, without an inventory)?"""
        return self.membership is None or device in self.membership

    def groups_of(self, device: str) -> list[str]:
        if self.membership is not None:
            return list(self.membership.get(device, []))
        st = self.devices.get(device)
        return list(st.groups) if st is not None else []

    def update(self, device: str, st: Status | None) -> Status | None:
        """Apply one status from ``device`` (the id in its topic, see
        fleet.mqtt.device_message); returns it when it changed what we know."""
        if st is None:
            return None  # a cleared retained status: the device was decommissioned
        if not self.listed(device):
            if device not in self._unlisted:  # once per device, not per status
                self._unlisted.add(device)
                log.warning("status of a device the inventory does not list: ignored",
                            extra={"device": device})
            return None
        if self.membership is not None and sorted(set(st.groups)) != self.groups_of(device):
            log.warning("a device's status names groups the inventory does not give it: "
                        "the inventory's count", extra={
                            "device": device, "claimed_groups": st.groups,
                            "groups": self.groups_of(device)})
        old = self.devices.get(device)
        if old is not None and (st.conn_seq, st.ts) < (old.conn_seq, old.ts):
            return None
        self.devices[device] = st
        self.last_change = time.monotonic()
        return st

    def select(self, group: str | None = None, devices: Iterable[str] | None = None) -> list[str]:
        if devices is not None:
            return sorted(devices)
        return sorted(d for d in self.devices if group is None or group in self.groups_of(d))

    def rows(self, group: str | None = None) -> list[dict[str, Any]]:
        out = []
        for d in self.select(group):
            st = self.devices[d]
            out.append({
                "device": d, "state": st.state, "conn_seq": st.conn_seq,
                "model": st.model.name if st.model else None,
                "version": st.model.version if st.model else None,
                "sequence": st.model.sequence if st.model else None,
                "groups": self.groups_of(d), "agent_version": st.agent_version,
                "ts": st.model_dump(mode="json")["ts"],
            })
        return out


def discover(conn: FleetConnection, *, settle_s: float = 0.5, max_s: float = 5.0,
             membership: Mapping[str, list[str]] | None = None) -> Inventory:
    """Collect retained statuses: the broker sends them right after SUBACK; we stop once no
    message at all has arrived for ``settle_s`` (MQTT has no end-of-retained marker).

    A message the fleet drops (garbled, on a foreign topic, or a payload claiming another
    device than its topic's: logged by fleet.mqtt.device_message) still counts as one that
    came: a device cannot end discovery early, before the statuses behind its own, by
    retaining a forgery on its topic.
    """
    inv = Inventory(membership)
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        arrived, msgs = conn.receive_counted(settle_s)
        if not arrived:
            break
        for m in msgs:
            if m.kind == "status":
                inv.update(m.device, m.body if isinstance(m.body, Status) else None)
    return inv


def render_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain fixed-width table (stdout stays greppable)."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=False))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ",".join(str(x) for x in v) or "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
