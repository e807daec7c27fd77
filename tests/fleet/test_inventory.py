"""Inventory from retained status: conn_seq decides, so a late last will never hides a
reconnected device; the device id is the topic's, checked at the edge."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest

from contract import Event, ModelInfo, Result, Status, Telemetry, Topics
from fleet.inventory import Inventory, render_table
from fleet.mqtt import device_message

T0 = datetime(2026, 11, 23, 5, 31, tzinfo=timezone.utc)


def status(dev: str, state: str, conn_seq: int, dt_s: float = 0, groups: tuple[str, ...] = ("a",)
           ) -> Status:
    return Status(state=state, device=dev, conn_seq=conn_seq, boot_id="b", agent_version="1",  # type: ignore[arg-type]
                  model=ModelInfo(name="digits", version="v1"), groups=list(groups),
                  ts=T0 + timedelta(seconds=dt_s))


def test_late_will_of_an_older_connection_is_ignored() -> None:
    inv = Inventory()
    inv.update("d1", status("d1", "online", 1))
    inv.update("d1", status("d1", "online", 2, 5))  # reconnected
    assert inv.update("d1", status("d1", "offline", 1, 10)) is None  # the old session's will
    assert inv.devices["d1"].state == "online" and inv.devices["d1"].conn_seq == 2
    assert inv.update("d1", status("d1", "offline", 2, 20)) is not None  # this session's will
    assert inv.devices["d1"].state == "offline"


def test_membership_from_the_operators_inventory(caplog: pytest.LogCaptureFixture) -> None:
    """With the operator's inventory the groups a status claims count for nothing, and a
    device the inventory does not list is not in the fleet."""
    inv = Inventory({"d1": ["a"], "d2": ["a", "b"]})
    with caplog.at_level(logging.WARNING, logger="fleet.inventory"):
        assert inv.update("d1", status("d1", "online", 1, groups=("a", "b"))) is not None
        assert inv.update("d2", status("d2", "online", 1, groups=())) is not None
        assert inv.update("d9", status("d9", "online", 1, groups=("b",))) is None
        inv.update("d9", status("d9", "online", 2, groups=("b",)))
    assert inv.select("b") == ["d2"] and inv.select() == ["d1", "d2"]
    assert [r["groups"] for r in inv.rows()] == [["a"], ["a", "b"]]
    assert not inv.listed("d9") and "d9" not in inv.devices
    unlisted = [r for r in caplog.records if getattr(r, "device", None) == "d9"]
    assert len(unlisted) == 1  # once per device
    assert any(getattr(r, "claimed_groups", None) == ["a", "b"] for r in caplog.records)


def test_groups_and_cleared_status() -> None:
    inv = Inventory()
    inv.update("d1", status("d1", "online", 1, groups=("a", "b")))
    inv.update("d2", status("d2", "online", 1, groups=("b",)))
    assert inv.update("d2", None) is None  # cleared retained status
    assert inv.select("a") == ["d1"] and inv.select("b") == ["d1", "d2"]
    assert inv.select(devices=["z", "d2"]) == ["d2", "z"]
    table = render_table(inv.rows("b"), ["device", "state", "version", "groups"])
    assert table.splitlines()[1].split() == ["d1", "online", "v1", "a,b"]


def test_device_messages_are_checked_at_the_edge(caplog: pytest.LogCaptureFixture) -> None:
    """The topic names the sender; a payload naming another device, garbage and foreign
    topics never get past fleet.mqtt.device_message."""
    t = Topics()
    m = device_message(t, t.status("d1"), status("d1", "online", 1).to_payload())
    assert m is not None and (m.device, m.kind) == ("d1", "status")
    assert isinstance(m.body, Status)
    cleared = device_message(t, t.status("d1"), b"")
    assert cleared is not None and cleared.body is None
    with caplog.at_level(logging.WARNING, "fleet.mqtt"):
        assert device_message(t, t.status("d1"), status("d2", "online", 9).to_payload()) is None
    rec = caplog.records[-1]
    assert (rec.topic, rec.claimed_device) == (t.status("d1"), "d2")  # type: ignore[attr-defined]
    res = Result(id="c1", device="d2", status="SUCCEEDED", seq=0, ts=T0).to_payload()
    assert device_message(t, t.result("d1"), res) is None
    evt = Event(device="d2", kind="error", seq=0, ts=T0).to_payload()
    assert device_message(t, t.event("d1", "error"), evt) is None
    got = device_message(t, t.result("d2"), res)
    assert got is not None and got.device == "d2" and isinstance(got.body, Result)
    tel = Telemetry(ts=T0, seq=0).to_payload()  # names no device: the topic's
    got = device_message(t, t.telemetry("d1"), tel)
    assert got is not None and got.device == "d1"
    assert device_message(t, t.status("d1"), b"{not json") is None
    assert device_message(t, "other/v1/dev/d1/status", res) is None
    assert device_message(t, t.command("d1", "ping"), b"{}") is None
    assert device_message(t, t.status("-d1"), status("-d1", "online", 1).to_payload()) is None
