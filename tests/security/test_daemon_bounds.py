"""Everything the daemon holds for others has a bound: queued jobs, history, the response
topics it stores, control-socket clients, and the size of a command it will even receive.
Attacks on a real ``edge-agent`` and a real mosquitto; each also shows nothing was lost (the
active model verifies, the honest job queued beside the attack runs)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.jobs.store import JobStore
from contract import MAX_PAYLOAD_BYTES, TERMINAL_STATUSES, Topics
from tests.agent.daemon.conftest import (  # noqa: F401 (fixtures)
    AgentProc,
    agent,
    assert_active_verified,
    command,
    device,
    device_template,
    secret_file,
)
from tests.security.conftest import SecureBroker
from tests.support.device import ProvisionedDevice
from tests.support.mosquitto import ACL_FLEET, Broker
from tests.support.mqtt import Peer, Received
from tests.support.registry_fixtures import upstream_key  # noqa: F401 (fixture)
from tests.support.waiting import until

T = Topics()


def _config(sb: SecureBroker, dev: ProvisionedDevice, tmp_path: Path,
            **cfg: Any) -> dict[str, Any]:
    pw = secret_file(tmp_path / "dev-a.password", sb.password("devices", "dev-a"))
    out: dict[str, Any] = {**dev.agent_config(), "mqtt": {"password_file": str(pw)}}
    out.update(cfg)
    return out


def _res(cid: str, *statuses: str) -> Callable[[Received], bool]:
    return lambda m: (m.topic == T.result("dev-a") and m.json().get("id") == cid
                      and (not statuses or m.json()["status"] in statuses))


def _start(sb: SecureBroker, agent: Callable[..., AgentProc], cfg: dict[str, Any]  # noqa: F811
           ) -> tuple[AgentProc, Peer]:
    op = sb.operator("fleet-send").subscribe(T.result("dev-a"), T.status("dev-a"))
    a = agent(sb.devices, **cfg)
    op.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online",
                timeout_s=20)
    return a, op


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_queue_is_bounded_and_a_refusal_is_not_stored(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    a, op = _start(sb, agent, _config(sb, device, tmp_path))  # limits: the defaults (16)
    try:
        first = command("finetune", args=device.finetune_args(steps=40))
        op.publish(T.command("dev-a", "finetune"), first)
        op.wait_for(_res(first["id"], "IN_PROGRESS"), timeout_s=30)
        flood = [command("finetune", args=device.finetune_args()) for _ in range(40)]
        for c in flood:
            op.publish(T.command("dev-a", "finetune"), c, wait=False)
        for c in flood:
            op.wait_for(_res(c["id"], "ACCEPTED", "REJECTED"), timeout_s=30)
        status = {c["id"]: op.matching(_res(c["id"]))[0].json() for c in flood}
        accepted = [i for i, r in status.items() if r["status"] == "ACCEPTED"]
        refused = [r for r in status.values() if r["status"] == "REJECTED"]
        assert len(accepted) == 16 and len(refused) == 24, [r["status"] for r in status.values()]
        assert all(r["error"]["code"] == "UNAVAILABLE" and r["error"]["retryable"]
                   and "queue full" in r["error"]["message"] for r in refused), refused[0]
        store = JobStore(device.state)
        assert len(store.list(limit=100)) == 1 + 16  # refusals leave no record
        for cid in accepted:
            op.publish(T.command("dev-a", "cancel"), command("cancel", args={"job_id": cid}))
        for cid in accepted:
            op.wait_for(_res(cid, "CANCELED"), timeout_s=30)
        # A refused id comes back once there is room: it was never stored, so it runs.
        retry = next(c for c in flood if c["id"] not in accepted)
        op.publish(T.command("dev-a", "finetune"), retry)
        for cid in (first["id"], retry["id"]):
            # (The retry's earlier REJECTED is not its end: wait for the job's own.)
            end = op.wait_for(_res(cid, "SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"),
                              timeout_s=180)[-1].json()
            assert end["status"] == "SUCCEEDED", end
        assert_active_verified(device.state, end["result"]["model"]["version"])
    finally:
        op.close()
    assert a.stop() == 0


def test_huge_response_topics_are_refused_and_the_state_stays_small(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    a, op = _start(sb, agent, _config(sb, device, tmp_path))
    before = _du(device.state)
    try:
        # 500 commands each asking for its results on a 30 KB topic (the device's own subtree:
        # one the broker would let it write): each would be stored with every result.
        long_topic = T.result("dev-a") + "/" + "x" * 30_000
        sent = [command("finetune", args=device.finetune_args()) for _ in range(500)]
        for c in sent:
            op.publish(T.command("dev-a", "finetune"), c, response_topic=long_topic,
                       correlation=b"c", wait=False)
        for c in sent:
            got = op.wait_for(_res(c["id"], "REJECTED"), timeout_s=60)[-1].json()
        assert got["error"]["code"] == "BAD_ENVELOPE" and "response topic" in (
            got["error"]["message"]), got
        assert JobStore(device.state).count(["QUEUED", "IN_PROGRESS"]) == 0
        # The honest request/response still works, answered on its (short) response topic
        # with its correlation data (the operator account may read the result topic only).
        honest = command("finetune", args=device.finetune_args())
        op.publish(T.command("dev-a", "finetune"), honest, response_topic=T.result("dev-a"),
                   correlation=b"k1")
        end = op.wait_for(lambda m: _res(honest["id"], *TERMINAL_STATUSES)(m)
                          and m.correlation == b"k1", timeout_s=180)[-1]
        assert end.json()["status"] == "SUCCEEDED" and end.correlation == b"k1", end.json()
        assert_active_verified(device.state, end.json()["result"]["model"]["version"])
        # It was 0.5 -> 88 MB. What is left: 500 REJECTED rows (and the honest job's own
        # folder); the write-ahead logs shrink back to 1 MB after their next checkpoint.
        time.sleep(2.5)  # the outbox's checkpoint runs every 2 s
        growth = _du(device.state) - before
        assert growth < 6 << 20, growth
    finally:
        op.close()
    assert a.stop() == 0


def test_expired_queued_jobs_end_at_once_and_the_next_job_starts(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    a, op = _start(sb, agent, _config(sb, device, tmp_path))
    try:
        first = command("finetune", args=device.finetune_args(steps=30))
        op.publish(T.command("dev-a", "finetune"), first)
        op.wait_for(_res(first["id"], "IN_PROGRESS"), timeout_s=30)
        soon = (datetime.now(timezone.utc) + timedelta(seconds=1)).isoformat()
        stale = [command("finetune", args=device.finetune_args(), expires_at=soon)
                 for _ in range(12)]
        honest = command("finetune", args=device.finetune_args())
        for c in [*stale, honest]:
            op.publish(T.command("dev-a", "finetune"), c)
        done = op.wait_for(_res(first["id"], *TERMINAL_STATUSES), timeout_s=180)[-1]
        assert done.json()["status"] == "SUCCEEDED"
        started = op.wait_for(_res(honest["id"], "IN_PROGRESS"), timeout_s=60)[0]
        # One second each before: 12 s. Now they end one after the other at once.
        assert started.at - done.at < 4.0, started.at - done.at
        for c in stale:
            end = op.wait_for(_res(c["id"], *TERMINAL_STATUSES))[-1].json()
            assert end["status"] == "EXPIRED" and end["error"]["code"] == "EXPIRED", end
        end = op.wait_for(_res(honest["id"], *TERMINAL_STATUSES), timeout_s=180)[-1].json()
        assert end["status"] == "SUCCEEDED", end
        assert_active_verified(device.state, end["result"]["model"]["version"])
    finally:
        op.close()
    assert a.stop() == 0


def test_history_is_pruned_by_count_but_never_a_job_that_has_not_ended(
    secure_broker: Callable[..., SecureBroker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    sb = secure_broker()
    cfg = _config(sb, device, tmp_path, limits={"keep_finished_jobs": 10,
                                                 "keep_command_records": 10,
                                                 "progress_interval_s": 0.2})
    a, op = _start(sb, agent, cfg)
    try:
        running = command("finetune", args=device.finetune_args(steps=30))
        op.publish(T.command("dev-a", "finetune"), running)
        op.wait_for(_res(running["id"], "IN_PROGRESS"), timeout_s=30)
        queued = command("finetune", args=device.finetune_args())
        op.publish(T.command("dev-a", "finetune"), queued)
        junk = [command("finetune", args={"model": "digits", "data": f"nope{i}"})
                for i in range(40)] + [command("ping") for _ in range(40)]
        for c in junk:
            op.publish(T.command("dev-a", c["type"]), c, wait=False)
        for c in junk:
            op.wait_for(_res(c["id"], "REJECTED", "SUCCEEDED"), timeout_s=30)
        # A restart prunes at once; the running and the queued job are kept whatever the count.
        a.kill9()
        a.start()
        store = JobStore(device.state)
        until(lambda: len(store.list(limit=1000)) <= 12, 30, "the store pruned to 12 jobs")
        ids = {r.id for r in store.list(limit=1000)}
        assert {running["id"], queued["id"]} <= ids
        for cid in (running["id"], queued["id"]):
            end = op.wait_for(_res(cid, *TERMINAL_STATUSES), timeout_s=240)[-1].json()
            assert end["status"] == "SUCCEEDED", end
        until(lambda: len(store.list(limit=1000)) <= 10, 30, "the store pruned to 10 jobs")
        assert {running["id"], queued["id"]} <= {r.id for r in store.list(limit=1000)}
        rows = _sql(device.state / "agent.db", "SELECT COUNT(*) FROM commands")[0][0]
        assert rows <= 10, rows
        assert_active_verified(device.state, end["result"]["model"]["version"])
    finally:
        op.close()
    assert a.stop() == 0


def _sql(db: Path, q: str) -> list[tuple[Any, ...]]:
    import sqlite3

    with sqlite3.connect(db, timeout=10) as c:
        return c.execute(q).fetchall()


# --- the control socket ----------------------------------------------------------------------


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder any user may enter (pytest's tmp_path is 0700): where a socket that others
    could reach would be."""
    d = Path(tempfile.mkdtemp(prefix="edge-agent-sock-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _status(path: Path) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(b'{"op": "status"}\n')
        return dict(json.loads(s.makefile("rb").readline()))


def test_control_socket_drops_idle_clients_and_caps_connections(
    agent: Callable[..., AgentProc], device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    nowhere = Broker("127.0.0.1", 1, tmp_path / "none.conf", tmp_path)  # never started
    a = agent(nowhere, **device.agent_config(),
              limits={"control_connections": 4, "control_timeout_s": 1.0})
    assert a.proc is not None
    path = device.state / "agent.sock"
    base = _threads(a.proc.pid)
    idle = []
    for _ in range(100):  # the 100 half-open clients that used to hold 100 threads
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        idle.append(s)
    time.sleep(0.3)
    assert _threads(a.proc.pid) <= base + 4
    turned_away = 0
    for s in idle:
        s.settimeout(5)
        line = s.makefile("rb").readline()  # an error line, or b"" once the timeout closed it
        turned_away += b"clients are connected already" in line
        s.close()
    # The first 4 were served (then closed at the timeout); the rest turned away at once.
    assert turned_away >= 90, turned_away
    until(lambda: _threads(a.proc.pid) <= base, 5,  # type: ignore[union-attr]
          f"the daemon back to {base} threads")
    assert _status(path)["status"]["device"] == "dev-a"  # the honest client is served
    assert_active_verified(device.state, "1")
    assert a.stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another user needs root")
def test_control_socket_checks_who_connects(
    agent: Callable[..., AgentProc], device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
    open_dir: Path,
) -> None:
    nowhere = Broker("127.0.0.1", 1, tmp_path / "none.conf", tmp_path)
    sock = open_dir / "agent.sock"
    client = ("import json, socket, sys\n"
              "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
              # Refused, the daemon answers before it reads: a late write may find it gone.
              "try:\n    s.sendall(b'{\"op\": \"status\"}\\n')\nexcept BrokenPipeError:\n    pass\n"
              "print(s.makefile('rb').readline().decode().strip())\n")

    def as_nobody() -> dict[str, Any]:
        p = subprocess.run(["/usr/bin/python3", "-I", "-c", client, str(sock)], user=65534,
                           group=65534, capture_output=True, text=True, timeout=30, cwd="/")
        assert p.returncode == 0, p.stderr
        return dict(json.loads(p.stdout))

    # No admin group: a socket made reachable by mistake (0666) still refuses a stranger.
    a = agent(nowhere, **device.agent_config(), control_socket=str(sock), socket_group=None)
    sock.chmod(0o666)
    got = as_nobody()
    assert "uid 65534 may not use this daemon" in got.get("error", ""), got
    assert "refused uid 65534" in a.log_text()
    assert _status(sock)["status"]["device"] == "dev-a"  # root is served
    assert a.stop() == 0
    # The same user as a member of the configured admin group is served.
    b = agent(nowhere, **device.agent_config(), control_socket=str(sock),
              socket_group="nogroup")
    sock.chmod(0o666)
    assert as_nobody()["status"]["device"] == "dev-a"
    assert_active_verified(device.state, "1")
    assert b.stop() == 0


# --- a command too large to receive ----------------------------------------------------------


def _hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM line")


def test_a_100_mib_command_never_reaches_the_daemon(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc],  # noqa: F811
    device: ProvisionedDevice, tmp_path: Path,  # noqa: F811
) -> None:
    # A broker with no max_packet_size of its own (mosquitto's default takes 256 MB): the
    # device's CONNECT Maximum Packet Size alone must keep the command away from it.
    broker = mosquitto(passwords={"dev-a": "dev-a-password-123", "fleet": "fleet-pw-123456"},
                       acl=ACL_FLEET)
    pw = secret_file(tmp_path / "dev-a.password", "dev-a-password-123")
    fleet = Peer(broker, username="fleet", password="fleet-pw-123456").subscribe(
        T.result("dev-a"), T.status("dev-a"))
    a = agent(broker, **device.agent_config(), mqtt={"password_file": str(pw)})
    assert a.proc is not None
    try:
        fleet.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online")
        base = _hwm_mb(a.proc.pid)
        big = command("finetune", args=device.finetune_args())
        body = json.dumps(big).encode()
        payload = body[:-1] + b', "pad": "' + b"x" * (100 << 20) + b'"}'
        info = fleet.client.publish(T.command("dev-a", "finetune"), payload, qos=1)
        info.wait_for_publish(120)  # the broker took it (it has no limit of its own)
        # Just over the contract's limit still arrives, and is answered TOO_LARGE.
        over = command("ping")
        fleet.publish(T.command("dev-a", "ping"),
                      json.dumps(over).encode()[:-1] + b', "p": "' + b"x" * MAX_PAYLOAD_BYTES
                      + b'"}')
        rej = fleet.wait_for(lambda m: m.topic == T.result("dev-a")
                             and m.json()["status"] == "REJECTED")[-1].json()
        assert rej["error"]["code"] == "TOO_LARGE", rej
        honest = command("finetune", args=device.finetune_args())
        fleet.publish(T.command("dev-a", "finetune"), honest)
        end = fleet.wait_for(_res(honest["id"], *TERMINAL_STATUSES), timeout_s=180)[-1].json()
        assert end["status"] == "SUCCEEDED", end
        assert not fleet.matching(_res(big["id"]))  # never delivered, never answered
        # It was 72 -> 378 MB; the daemon's peak now barely moves.
        assert _hwm_mb(a.proc.pid) - base < 20, (base, _hwm_mb(a.proc.pid))
        assert_active_verified(device.state, end["result"]["model"]["version"])
    finally:
        fleet.close()
    assert a.stop() == 0


def test_link_asks_the_broker_for_a_maximum_packet_size(tmp_path: Path) -> None:
    """The CONNECT property itself, as paho sends it (the test above shows mosquitto obeys)."""
    from agent.mqtt.link import MAX_INBOUND_PACKET_BYTES, LinkSettings, MqttLink
    from agent.mqtt.outbox import Outbox

    link = MqttLink(LinkSettings(client_id="d", host="h", port=1), Outbox(tmp_path),
                    before_connect=lambda: ("t", b""), on_connected=lambda s: None,
                    on_inbound=lambda m: None)
    props = link._connect_props()
    assert props.MaximumPacketSize == MAX_INBOUND_PACKET_BYTES < 2 * MAX_PAYLOAD_BYTES
