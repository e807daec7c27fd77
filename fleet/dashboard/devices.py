"""The device table: every device's retained status and latest telemetry, followed live over
MQTT on a connection of the dashboard's own (a thread), and the bounded views of it a page
asks for.

A fleet of 10,000 devices is never sent whole: :func:`view` gives the counts by state and one
page of rows, the devices that need attention first (offline, failed in a rollout, hot), after
a filter by group and a search on the id.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contract import Status, Telemetry, Topics
from fleet.inventory import Inventory
from fleet.mqtt import BrokerConfig, FleetConnection

HOT_C = 85.0
"""A device this hot (its hottest sensor) needs attention: Jetsons throttle from about here."""
TELEMETRY_STALE_S = 120.0
"""Telemetry older than this is not shown (the temperature and job it gave are old news)."""
PAGE_SIZE = 50
MAX_GROUPS = 200
"""Groups offered in the filter at most."""
STATES = ("all", "attention", "online", "offline", "running")


@dataclass
class _Tel:
    body: Telemetry
    at: float


class DeviceBoard:
    """The fleet's devices from MQTT, kept current by a thread (:meth:`start`)."""

    def __init__(self, broker: BrokerConfig, client_id: str,
                 membership: Mapping[str, list[str]] | None = None) -> None:
        t = Topics(broker.prefix)
        # MQTT 3.1.1: the table only watches, and v5's per-message properties were most of
        # its cost while 10,000 devices changed status (see FleetConnection).
        self.conn = FleetConnection(broker, client_id, [t.all_status(), t.all_telemetry()],
                                    v5=False)
        self.inv = Inventory(membership)
        self.telemetry: dict[str, _Tel] = {}
        self._groups: dict[str, list[str]] = {}
        """Each device's groups, kept at each status (not worked out at each table)."""
        self.version = 0
        """Grows with every change the table shows."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> DeviceBoard:
        self.conn.start(timeout_s)
        self._thread = threading.Thread(target=self._run, name="dashboard-devices", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.conn.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            msgs = self.conn.receive(0.2)
            if msgs:
                with self._lock:
                    for m in msgs:
                        self.apply(m.kind, m.device, m.body)

    def apply(self, kind: str, device: str, body: Any) -> None:
        """One device message (status or telemetry); the caller holds the lock."""
        if kind == "status":
            if self.inv.update(device, body if isinstance(body, Status) else None) is not None:
                self._groups[device] = self.inv.groups_of(device)
                self.version += 1
        elif kind == "telemetry" and isinstance(body, Telemetry) and self.inv.listed(device):
            self.telemetry[device] = _Tel(body, time.monotonic())
            self.version += 1

    def rows(self, running: Mapping[str, str], failed: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every device, those that need attention first, each as the table shows it;
        ``running`` / ``failed``: device -> the rollout job it runs / the reason it failed
        (from the state db)."""
        now = time.monotonic()
        with self._lock:
            items = list(self.inv.devices.items())
            groups = dict(self._groups)
            tel = dict(self.telemetry)
        out = []
        for dev, st in items:
            t = tel.get(dev)
            fresh = t is not None and now - t.at < TELEMETRY_STALE_S
            temp = max(t.body.temps_c.values()) if fresh and t and t.body.temps_c else None
            job = None
            if fresh and t and t.body.job is not None:
                job = f"{t.body.job.stage} ({t.body.job.id})"
            job = running.get(dev) or job
            why = []
            if st.state != "online":
                why.append("offline")
            if dev in failed:
                why.append(f"failed: {failed[dev]}")
            if temp is not None and temp >= HOT_C:
                why.append(f"hot: {temp:.0f} °C")
            out.append({
                "device": dev, "online": st.state == "online", "groups": groups.get(dev, []),
                "model": f"{st.model.name}@{st.model.version}" if st.model else None,
                "job": job, "temp_c": None if temp is None else round(temp, 1),
                "attention": "; ".join(why) or None,
            })
        out.sort(key=lambda r: (r["attention"] is None, r["online"], r["device"]))
        return out


def counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fleet's figures above the table, and the groups the filter offers."""
    groups: dict[str, int] = {}
    for r in rows:
        for g in r["groups"]:
            groups[g] = groups.get(g, 0) + 1
    return {
        "devices": len(rows), "online": sum(r["online"] for r in rows),
        "offline": sum(not r["online"] for r in rows),
        "attention": sum(r["attention"] is not None for r in rows),
        "running": sum(r["job"] is not None for r in rows),
        "groups": dict(sorted(groups.items())[:MAX_GROUPS]),
    }


class ViewError(ValueError):
    """A bad view parameter; the message names it and what it takes."""


@dataclass(frozen=True)
class View:
    """One page's filter: group, a search on the device id, a state, the page number."""

    group: str = ""
    q: str = ""
    state: str = "all"
    page: int = 1

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> View:
        unknown = set(params) - {"group", "q", "state", "page"}
        if unknown:
            raise ViewError(f"unknown parameter {sorted(unknown)[0]!r}: the view takes group, "
                            "q, state and page")
        group, q = params.get("group", ""), params.get("q", "")
        for name, v in (("group", group), ("q", q)):
            if len(v) > 64 or not re.fullmatch(r"[A-Za-z0-9._:@-]*", v):
                raise ViewError(f"{name}: up to 64 of A-Z a-z 0-9 . _ : @ -")
        state = params.get("state", "all")
        if state not in STATES:
            raise ViewError(f"state {state!r}: one of {', '.join(STATES)}")
        try:
            page = int(params.get("page", "1"))
        except ValueError:
            raise ViewError("page: a whole number from 1") from None
        if not 1 <= page <= 100_000:
            raise ViewError("page: a whole number from 1")
        return cls(group, q, state, page)

    def query(self) -> str:
        return f"group={self.group}&q={self.q}&state={self.state}&page={self.page}"


def view(rows: list[dict[str, Any]], v: View, size: int = PAGE_SIZE) -> dict[str, Any]:
    """One page of the table under the filter ``v`` (and how many devices it matches)."""
    q = v.q.lower()
    keep = [r for r in rows
            if (not v.group or v.group in r["groups"]) and (not q or q in r["device"].lower())
            and (v.state == "all" or (v.state == "attention" and r["attention"] is not None)
                 or (v.state == "online" and r["online"])
                 or (v.state == "offline" and not r["online"])
                 or (v.state == "running" and r["job"] is not None))]
    pages = max(1, -(-len(keep) // size))
    page = min(v.page, pages)
    return {"group": v.group, "q": v.q, "state": v.state, "page": page, "pages": pages,
            "matches": len(keep), "rows": keep[(page - 1) * size:page * size]}
