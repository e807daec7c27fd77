"""Inventory from retained status: conn_seq decides, so a late last will never hides a
reconnected device."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from agent.mqtt.contract import ModelInfo, Status
from fleet.inventory import Inventory, render_table

T0 = datetime(2026, 11, 23, 5, 31, tzinfo=timezone.utc)


def status(dev: str, state: str, conn_seq: int, dt_s: float = 0, groups: tuple[str, ...] = ("a",)
           ) -> bytes:
    return Status(state=state, device=dev, conn_seq=conn_seq, boot_id="b", agent_version="1",  # type: ignore[arg-type]
                  model=ModelInfo(name="digits", version="v1"), groups=list(groups),
                  ts=T0 + timedelta(seconds=dt_s)).to_payload()


def test_late_will_of_an_older_connection_is_ignored() -> None:
    inv = Inventory()
    inv.update(status("d1", "online", 1))
    inv.update(status("d1", "online", 2, 5))  # reconnected
    assert inv.update(status("d1", "offline", 1, 10)) is None  # the old session's will
    assert inv.devices["d1"].state == "online" and inv.devices["d1"].conn_seq == 2
    assert inv.update(status("d1", "offline", 2, 20)) is not None  # this session's will
    assert inv.devices["d1"].state == "offline"


def test_groups_garbage_and_cleared_status() -> None:
    inv = Inventory()
    inv.update(status("d1", "online", 1, groups=("a", "b")))
    inv.update(status("d2", "online", 1, groups=("b",)))
    assert inv.update(b"{not json") is None and inv.update(b"") is None
    assert inv.select("a") == ["d1"] and inv.select("b") == ["d1", "d2"]
    assert inv.select(devices=["z", "d2"]) == ["d2", "z"]
    table = render_table(inv.rows("b"), ["device", "state", "version", "groups"])
    assert table.splitlines()[1].split() == ["d1", "online", "v1", "a,b"]
