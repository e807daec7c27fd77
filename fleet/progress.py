"""Showing a rollout as it goes: tqdm bars per wave at a terminal, a log line per change
otherwise (journald and CI get JSON lines, not carriage returns)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from fleet.controller import RolloutRun, summarize
from fleet.inventory import render_table

log = logging.getLogger("fleet.progress")


def bar(done: int, total: int, width: int = 20) -> str:
    filled = 0 if total == 0 else round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def status_text(s: dict[str, Any]) -> str:
    """The per-wave table of ``fleetctl rollout status``."""
    head = f"rollout {s['id']}: {s['state']}" + (f" ({s['reason']})" if s["reason"] else "")
    rows = [{**w, "progress": bar(w["succeeded"] + w["failed"] + w["canceled"], w["devices"])}
            for w in s["waves"]]
    cols = ["wave", "state", "progress", "devices", "sent", "running", "succeeded", "failed",
            "canceled"]
    tail = f"targets {s['targets']}, rolled back {s['rolled_back']}"
    return "\n".join([head, render_table(rows, cols), tail])


class Progress:
    def __init__(self, enabled: bool = True) -> None:
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.bars: dict[tuple[str, int], Any] = {}
        self.last: dict[str, tuple[Any, ...]] = {}

    def update(self, run: RolloutRun) -> None:
        if not self.enabled:
            return
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
