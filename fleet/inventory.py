"""The fleet's devices, discovered from their retained status messages.

Status carries ``conn_seq``, which grows with each connection: a status with a lower
``conn_seq`` than the one we hold (a late last will of an older connection) is ignored, so a
device that reconnected is never shown offline by its previous session's will.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from agent.mqtt.contract import Status, Telemetry
from fleet.mqtt import FleetConnection


class Inventory:
    def __init__(self) -> None:
        self.devices: dict[str, Status] = {}
        self.telemetry: dict[str, Telemetry] = {}
        self.last_change = time.monotonic()

    def update(self, device: str, st: Status | None) -> Status | None:
        """Apply one status from ``device`` (the id in its topic, see
        fleet.mqtt.device_message); returns it when it changed what we know."""
        if st is None:
            return None  # a cleared retained status: the device was decommissioned
        old = self.devices.get(device)
        if old is not None and (st.conn_seq, st.ts) < (old.conn_seq, old.ts):
            return None
        self.devices[device] = st
        self.last_change = time.monotonic()
        return st

    def select(self, group: str | None = None, devices: Iterable[str] | None = None) -> list[str]:
        if devices is not None:
            return sorted(devices)
        return sorted(d for d, st in self.devices.items() if group is None or group in st.groups)

    def rows(self, group: str | None = None) -> list[dict[str, Any]]:
        out = []
        for d in self.select(group):
            st = self.devices[d]
            out.append({
                "device": d, "state": st.state, "conn_seq": st.conn_seq,
                "model": st.model.name if st.model else None,
                "version": st.model.version if st.model else None,
                "sequence": st.model.sequence if st.model else None,
                "groups": st.groups, "agent_version": st.agent_version,
                "ts": st.model_dump(mode="json")["ts"],
            })
        return out


def discover(conn: FleetConnection, *, settle_s: float = 0.5, max_s: float = 5.0) -> Inventory:
    """Collect retained statuses: the broker sends them right after SUBACK; we stop once none
    has arrived for ``settle_s`` (MQTT has no end-of-retained marker)."""
    inv = Inventory()
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        msgs = conn.receive(settle_s)
        if not msgs:
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
