"""``fleetctl send``: one command to a device or a group, and the replies that follow.

A group command is published ONCE on the group topic (the broker fans it out); the devices
to expect replies from are the group's members in the inventory. A device that answers
DEFERRED (busy fine-tuning or throttled) has answered for now: ``send`` does not send again
(a rollout does), it shows when the device asked to be asked again and counts it as not done.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from contract import (
    MAX_PAYLOAD_BYTES,
    TERMINAL_STATUSES,
    Command,
    Result,
    utc_now,
)
from fleet.mqtt import FleetConnection


@dataclass
class SendOutcome:
    command_id: str
    expected: list[str]
    last: dict[str, Result] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for d in self.expected:
            r = self.last.get(d)
            res = r.result or {} if r else {}
            out.append({
                "device": d,
                "status": r.status if r else "NO_REPLY",
                "code": r.error.code if r and r.error else None,
                "detail": (f"ask again in {r.recheck_after_s:g} s: {r.error.message}"
                           if r and r.status == "DEFERRED" and r.error
                           else r.error.message if r and r.error
                           else res.get("outcome") if isinstance(res, dict) else None),
            })
        return out

    def ok(self, wait: bool) -> bool:
        good = {"SUCCEEDED"} if wait else {"ACCEPTED", "IN_PROGRESS", "SUCCEEDED"}
        return all(d in self.last and self.last[d].status in good for d in self.expected)


def send(
    conn: FleetConnection,
    type_: str,
    args: dict[str, Any],
    *,
    devices: list[str],
    group: str | None = None,
    wait: bool = False,
    timeout_s: float = 30.0,
    command_timeout_s: float | None = None,
) -> SendOutcome:
    """Publish one command and follow the replies: until every device answered at once
    (ACCEPTED/REJECTED) or, with ``wait``, until every device reached a terminal status."""
    cid = f"send-{uuid.uuid4().hex[:16]}"
    cmd = Command(id=cid, type=type_, issued_at=utc_now(), timeout_s=command_timeout_s,  # type: ignore[arg-type]
                  args=args)
    t = conn.topics
    payload = cmd.to_payload()
    if len(payload) > MAX_PAYLOAD_BYTES:
        # Devices refuse it anyway, and past the broker's max_packet_size the broker would
        # drop this connection instead of answering.
        raise ValueError(f"the command is {len(payload)} bytes; the limit is "
                         f"{MAX_PAYLOAD_BYTES} (contract.MAX_PAYLOAD_BYTES)")
    if group is not None:
        conn.publish(t.group_command(group, type_), payload)
    else:
        for d in devices:
            conn.publish(t.command(d, type_), payload)
    out = SendOutcome(cid, sorted(devices))
    want = set(devices)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in conn.receive(0.1):
            # m.device is the topic's: a device cannot answer for another (fleet.mqtt).
            r = m.body
            if not isinstance(r, Result) or r.id != cid or m.device not in want:
                continue
            prev = out.last.get(m.device)
            if prev is None or prev.status not in TERMINAL_STATUSES:
                out.last[m.device] = r
        # DEFERRED ends the wait too: the device keeps no record of the command, so nothing
        # more comes unless it is sent again.
        done = TERMINAL_STATUSES | {"DEFERRED"} if wait else \
            TERMINAL_STATUSES | {"DEFERRED", "ACCEPTED", "IN_PROGRESS"}
        if all(d in out.last and out.last[d].status in done for d in want):
            break
    return out
