"""The daemon's life: sd_notify (READY, WATCHDOG period, a hung loop stops the pings), an
idle main loop that sleeps until its next deadline,
kill -9 and restart (last will, higher conn_seq, commands sent while it was down), a broker
outage (results wait in the on-disk outbox), SIGTERM (STOPPING=1, offline, exit 0)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.daemon.config import AgentConfig
from agent.daemon.main import Daemon
from agent.daemon.sdnotify import Notifier
from contract import Topics
from tests.agent.daemon.conftest import AgentProc, Notify, command
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer

T = Topics()


def _pings(notify: Notify, seconds: float) -> list[float]:
    start = len(notify.messages)
    notify.drain(seconds)
    return [at for at, m in notify.messages[start:] if "WATCHDOG=1" in m.split("\n")]


def test_sd_notify_ready_watchdog_and_hung_loop(
    tmp_path: Path, mosquitto: Callable[..., Broker]
) -> None:
    broker = mosquitto()
    notify = Notify(tmp_path / "notify.sock")
    cfg = AgentConfig.model_validate({
        "device_id": "dev-a", "state_dir": str(tmp_path / "state"), "sensors": "none",
        "socket_group": None, "telemetry_s": 0,
        "mqtt": broker.agent_mqtt()})
    # WATCHDOG_USEC=400 ms: pings every 200 ms from the main loop.
    d = Daemon(cfg, notifier=Notifier({"NOTIFY_SOCKET": str(notify.path),
                                       "WATCHDOG_USEC": "400000"}))
    t = threading.Thread(target=d.run)
    t.start()
    try:
        notify.wait_for("READY=1", 10)
        pings = _pings(notify, 2.0)
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert 7 <= len(pings) <= 12, pings
        assert max(gaps) < 0.35 and min(gaps) > 0.1, gaps
        # A main loop stuck (here: in a hook, as in a hung sensor read) stops the pings.
        release = threading.Event()
        d.loop_hook = release.wait
        time.sleep(0.3)
        assert _pings(notify, 1.5) == []
        d.loop_hook = None
        release.set()
        assert len(_pings(notify, 1.0)) >= 3
    finally:
        d.stop_event.set()
        t.join(30)
    notify.wait_for("STOPPING=1", 1)
    notify.close()


def _idle_turns(cfg: AgentConfig, settle_s: float, over_s: float) -> int:
    """Turns of the daemon's main loop over ``over_s``, ``settle_s`` after it started."""
    d = Daemon(cfg, notifier=Notifier({}))
    turns: list[float] = []
    d.loop_hook = lambda: turns.append(time.monotonic())
    t = threading.Thread(target=d.run)
    t.start()
    try:
        time.sleep(settle_s)
        start = len(turns)
        time.sleep(over_s)
        return len(turns) - start
    finally:
        d.stop_event.set()
        t.join(30)


def test_an_idle_main_loop_waits_for_its_next_deadline(
    tmp_path: Path, mosquitto: Callable[..., Broker]
) -> None:
    # Telemetry every 10 s (the default) or none, no metrics, no watchdog: a turn a second
    # (the status line, the outbox checkpoint). A schedule that does not run must not pull the
    # wait down: its stale deadline once made every wait the 10 ms floor, 100 turns a second.
    broker = mosquitto()
    for telemetry_s in (10.0, 0.0):
        cfg = AgentConfig.model_validate({
            "device_id": "dev-a", "state_dir": str(tmp_path / f"state-{telemetry_s:g}"),
            "sensors": "none", "socket_group": None, "telemetry_s": telemetry_s,
            "mqtt": broker.agent_mqtt()})
        turns = _idle_turns(cfg, settle_s=1.2, over_s=2.0)  # settled: past every first deadline
        assert turns <= 6, (telemetry_s, turns)


def test_kill9_restart_last_will_conn_seq_and_offline_commands(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc]
) -> None:
    broker = mosquitto()
    fleet = Peer(broker).subscribe(T.status("dev-a"), T.result("dev-a"))
    a = agent(broker)

    def status(state: str, count: int = 1) -> dict:
        return fleet.wait_for(lambda m: m.topic == T.status("dev-a")
                              and m.json()["state"] == state, count=count)[-1].json()

    first = status("online")
    a.kill9()
    will = status("offline")
    assert will["conn_seq"] == first["conn_seq"]
    ping = command("ping")  # sent while the daemon is down: waits in its broker session
    fleet.publish(T.command("dev-a", "ping"), ping)
    a.start()
    second = status("online", count=2)
    assert second["conn_seq"] > will["conn_seq"]
    got = fleet.wait_for(lambda m: m.topic == T.result("dev-a")
                         and m.json()["id"] == ping["id"], count=2)
    assert [m.json()["status"] for m in got] == ["ACCEPTED", "SUCCEEDED"]
    assert a.stop() == 0
    a.notify.wait_for("STOPPING=1", 1)  # type: ignore[union-attr]
    assert status("offline", count=2)["conn_seq"] == second["conn_seq"]
    fleet.close()


def test_broker_outage_results_wait_in_the_outbox(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc]
) -> None:
    broker = mosquitto(persistence=True)
    a = agent(broker, mqtt={"reconnect_min_s": 2.0, "reconnect_max_s": 3.0})
    broker.stop()
    # The cloud is unreachable; agentctl still talks to the daemon over its socket.
    ping = command("ping")
    out = a.socket_request({"op": "command", "command": ping})
    assert [r["result"]["status"] for r in out if "result" in r] == ["ACCEPTED", "SUCCEEDED"]
    st = a.socket_request({"op": "status"})[0]["status"]
    assert st["connected"] is False and st["outbox"] >= 2
    time.sleep(1.0)
    broker.start()
    fleet = Peer(broker).subscribe(T.result("dev-a"))  # before the daemon's back-off ends
    got = fleet.wait_for(lambda m: m.json()["id"] == ping["id"], count=2, timeout_s=15)
    assert [m.json()["status"] for m in got] == ["ACCEPTED", "SUCCEEDED"]
    deadline = time.monotonic() + 5
    while a.socket_request({"op": "status"})[0]["status"]["outbox"] and (
            time.monotonic() < deadline):
        time.sleep(0.1)
    assert a.socket_request({"op": "status"})[0]["status"]["outbox"] == 0
    assert a.stop() == 0
    fleet.close()
