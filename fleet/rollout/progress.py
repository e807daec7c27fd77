"""Showing a rollout as it goes: tqdm bars per wave at a terminal, a log line per change
otherwise (journald and CI get JSON lines, not carriage returns)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from fleet.inventory import render_table
from fleet.rollout.run import RolloutRun, summarize

log = logging.getLogger("fleet.progress")


def bar(done: int, total: int, width: int = 20) -> str:
    filled = 0 if total == 0 else round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def headline(rid: str, s: dict[str, Any]) -> str:
    """``rollout ID: STATE (why)``; a rollout that finished with failed devices says how
    many of the devices its waves targeted failed, never just that it finished."""
    head = f"rollout {rid}: {s['state']}"
    why = [s["reason"]] if s.get("reason") else []
    if s["state"] == "waiting_approval":
        nxt = next((w["wave"] for w in s["waves"] if w["state"] == "pending"), None)
        why.append(f"wave {nxt} waits: fleetctl rollout approve {rid}")
    if s["state"] == "completed_with_failures":
        failed = sum(w["failed"] for w in s["waves"])
        why.append(f"{failed} of {sum(w['devices'] for w in s['waves'])} devices failed")
    return head + (f" ({'; '.join(why)})" if why else "")


FAILURE_COLUMNS = ["device", "wave", "attempt", "status", "code", "message"]
MAX_FAILURE_ROWS = 50


def failures_text(failures: list[dict[str, Any]], more: str = "--json lists them all") -> str:
    """``failed devices (N):`` and one row per device with its reason; "" when none."""
    if not failures:
        return ""
    rows = [{**f, "message": " ".join(str(f["message"] or "").split())[:160] or None}
            for f in failures[:MAX_FAILURE_ROWS]]
    lines = [f"failed devices ({len(failures)}):", render_table(rows, FAILURE_COLUMNS)]
    if len(failures) > MAX_FAILURE_ROWS:
        lines.append(f"... and {len(failures) - MAX_FAILURE_ROWS} more ({more})")
    return "\n".join(lines)


def status_text(s: dict[str, Any]) -> str:
    """``fleetctl rollout status``: the headline, the per-wave table, then each device that
    failed for good with its reason."""
    rows = [{**w, "progress": bar(w["succeeded"] + w["failed"] + w["canceled"], w["devices"])}
            for w in s["waves"]]
    cols = ["wave", "state", "progress", "devices", "sent", "running", "deferred", "succeeded",
            "failed", "canceled"]
    tail = f"targets {s['targets']}, rolled back {s['rolled_back']}"
    if s.get("rate_per_minute") is not None:
        tail += f", rate {s['rate_per_minute']}/min"
    if s.get("approved_wave") is not None:
        tail += f", approved through wave {s['approved_wave']}"
    failed = failures_text(s.get("failures") or [])
    return "\n".join([headline(s["id"], s), render_table(rows, cols), tail,
                      *([failed] if failed else [])])


class Progress:
    def __init__(self, enabled: bool = True) -> None:
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.bars: dict[tuple[str, int], Any] = {}
        self.last: dict[str, tuple[Any, ...]] = {}
        self.drawn: dict[str, tuple[str, float]] = {}

    def update(self, run: RolloutRun) -> None:
        if not self.enabled:
            return
        # Four times a second at most while the state holds: summarize reads every
        # execution, and the controller calls this every turn.
        rid, state, now = run.rollout.id, run.rollout.state, time.monotonic()
        last_state, last_t = self.drawn.get(rid, ("", 0.0))
        if state == last_state and now - last_t < 0.25:
            return
        self.drawn[rid] = (state, now)
        s = summarize(run)
        key = (s["state"], *((w["state"], w["succeeded"], w["failed"]) for w in s["waves"]))
        if self.last.get(s["id"]) == key:
            return
        self.last[s["id"]] = key
        if not self.tty:
            log.info("rollout progress", extra={
                "rollout": s["id"], "state": s["state"], "reason": s["reason"],
                "waves": [(w["wave"], w["state"], w["succeeded"], w["failed"], w["devices"])
                          for w in s["waves"]]})
            return
        from tqdm import tqdm

        for w in s["waves"]:
            k = (s["id"], w["wave"])
            if k not in self.bars:
                self.bars[k] = tqdm(total=w["devices"], desc=f"{s['id']} wave {w['wave']}",
                                    position=len(self.bars), leave=True, unit="dev")
            b = self.bars[k]
            b.n = w["succeeded"] + w["failed"] + w["canceled"]
            b.set_postfix_str(f"{w['state']} ok={w['succeeded']} failed={w['failed']}",
                              refresh=False)
            b.refresh()

    def close(self) -> None:
        for b in self.bars.values():
            b.close()
        self.bars.clear()
