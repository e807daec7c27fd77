"""Live updates: one thread reads the state db and the device table every ``period_s``
(:class:`Hub`), and each open page gets, over server-sent events, a full snapshot when it
connects, then only what changed since its last event (a diff: the sections that changed, and
of the rollouts only those that changed), compact JSON each.

Bounded: at most ``max_clients`` pages follow at once (one more is answered 503), each
stream's send is cut when a page stops reading (the HTTP server's write timeout), and a
heartbeat comment goes every ``PING_S`` so proxies and the browser keep the stream open and a
dead one is noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fleet.dashboard.devices import DeviceBoard, View, counts, view
from fleet.dashboard.snapshot import FleetReader, compact

log = logging.getLogger("fleet.dashboard")

PING_S = 15.0
BOARD_PERIOD_S = 1.0
BOARD_COST_FACTOR = 20.0
"""The device table (its rows depend on the devices' statuses and telemetry and on which
rollout runs or failed where) is rebuilt at most every ``BOARD_PERIOD_S``, or every
``BOARD_COST_FACTOR`` x the CPU its last rebuild took when that is longer (up to 5 s): a
table of 10,000 devices costs tens of ms, so it takes at most 1/20 of a core, however fast
statuses and rollouts change. The rollouts' cards do not wait for it."""


class Busy(Exception):
    """Every live-update slot is taken."""


class Hub:
    """The shared state every page is cut from, refreshed by one thread."""

    def __init__(self, reader: FleetReader, board: DeviceBoard | None, *,
                 period_s: float = 0.25, max_clients: int = 32) -> None:
        self.reader, self.board = reader, board
        self.period_s, self.max_clients = period_s, max_clients
        self.version = 0
        self.state: dict[str, Any] = {"rollouts": {}, "order": [], "learns": [],
                                      "fleet": counts([]), "read_at": 0.0}
        self.rows: list[dict[str, Any]] = []
        self.clients = 0
        self.error: str | None = None
        self._db_key: Any = None
        self._devices_key: Any = None
        self._board_due = 0.0
        self._fleet = counts([])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> Hub:
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="dashboard-hub", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        self._notify()

    @property
    def closing(self) -> bool:
        return self._stop.is_set()

    def poke(self) -> None:
        """Read now, not at the next tick (after a write: the page shows it at once)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.refresh()
                self.error = None
            except Exception as e:  # a db hiccup (locked, restarted): shown, tried again
                if self.error != str(e):
                    log.warning("reading the state db failed: %s", e)
                self.error = str(e)

    def refresh(self) -> bool:
        """Read once; True (and the subscribers woken) when what the pages show changed."""
        db = self.reader.read()
        key = compact([db["rollouts"], db["learns"]])
        devices_key = (db["devices_key"], self.board.version if self.board is not None else 0)
        now = time.monotonic()
        rows, fleet = self.rows, self._fleet
        board_due = devices_key != self._devices_key and now >= self._board_due
        if key == self._db_key and not board_due:
            return False  # nothing new, or only the table's and not yet its turn
        if board_due:
            t0 = time.thread_time()
            rows = (self.board.rows(db["running"], db["failed"]) if self.board is not None
                    else [])
            fleet = counts(rows)
            cost = time.thread_time() - t0
            self._board_due = now + min(5.0, max(BOARD_PERIOD_S, BOARD_COST_FACTOR * cost))
            self._devices_key, self._fleet = devices_key, fleet
        with self._lock:
            self.rows = rows
            self.state = {"rollouts": db["rollouts"], "order": db["order"],
                          "learns": db["learns"], "fleet": fleet, "read_at": time.time()}
            self.version += 1
        self._db_key = key
        self._notify()
        return True

    # --- subscribers (the event loop's side) ------------------------------------------

    def _notify(self) -> None:
        loop, ev = self._loop, self._changed
        if loop is not None and ev is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(ev.set)

    def page(self, v: View) -> dict[str, Any]:
        """What one page shows: the shared sections and its own slice of the table."""
        with self._lock:
            state, rows, version = self.state, self.rows, self.version
        return {**state, "devices": view(rows, v), "version": version, "error": self.error}

    def subscribe(self) -> None:
        if self.clients >= self.max_clients:
            raise Busy(f"{self.max_clients} live views are open already (the cap): close one, "
                       "or start the dashboard with a higher --max-live")
        self.clients += 1

    def unsubscribe(self) -> None:
        self.clients -= 1

    async def wait(self, version: int, timeout_s: float) -> None:
        """Until the state is newer than ``version`` (or ``timeout_s``)."""
        if self._changed is None:
            self._loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()
        while self.version == version and not self.closing:
            ev = self._changed
            try:
                await asyncio.wait_for(ev.wait(), timeout_s)
            except asyncio.TimeoutError:
                return
            ev.clear()

    async def events(self, v: View) -> AsyncIterator[dict[str, str]]:
        """The stream of one page (already subscribed: this unsubscribes when it ends)."""
        try:
            cur = self.page(v)
            yield {"event": "snapshot", "data": compact(cur)}
            sent = _sections(cur)
            while not self.closing:
                await self.wait(cur["version"], 1.0)
                if self.closing:
                    break
                nxt = self.page(v)
                if nxt["version"] == cur["version"] and nxt["error"] == cur["error"]:
                    continue
                now = _sections(nxt)
                diff = diff_sections(sent, now)
                cur, sent = nxt, now
                if diff:
                    diff["version"] = nxt["version"]
                    diff["read_at"] = nxt["read_at"]
                    yield {"event": "diff", "data": compact(diff)}
        finally:
            self.unsubscribe()


def _sections(page: dict[str, Any]) -> dict[str, Any]:
    """The page as comparable parts: each rollout on its own, the rest by section."""
    out: dict[str, Any] = {f"rollout:{rid}": compact(s) for rid, s in page["rollouts"].items()}
    for k in ("order", "learns", "fleet", "devices", "error"):
        out[k] = compact(page[k])
    return out


def diff_sections(old: dict[str, str], new: dict[str, str]) -> dict[str, Any]:
    """What changed from ``old`` to ``new`` (both :func:`_sections`): ``rollouts`` holds
    only the changed rollouts (``order`` says which are still shown), the other sections
    whole when they changed."""
    out: dict[str, Any] = {}
    changed = {k.split(":", 1)[1]: json.loads(v) for k, v in new.items()
               if k.startswith("rollout:") and old.get(k) != v}
    if changed:
        out["rollouts"] = changed
    for k in ("order", "learns", "fleet", "devices", "error"):
        if old.get(k) != new[k]:
            out[k] = json.loads(new[k])
    return out
