"""Events and telemetry from a daemon running in this process against a real mosquitto.

The job worker here is a short script in a real subprocess that writes to the real job store
what the fine-tune child writes (progress with the governor's state: NORMAL -> THROTTLED ->
NORMAL) and then a terminal state with a JobOutcome: a thermal governor cannot heat up on
this machine, and the real worker's model_committed is covered by test_job_faults.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.daemon.config import AgentConfig
from agent.daemon.main import Daemon
from contract import TELEMETRY_EXPIRY_S, Event, Telemetry, Topics
from tests.agent.daemon.conftest import command
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer

T = Topics()

SCRIPT = """
import sys, time
from pathlib import Path
from typing import Any
from agent.jobs.store import JobState, JobStore
state, jid = Path(sys.argv[1]), sys.argv[2]
s = JobStore(state)
rec = s.transition(jid, JobState.IN_PROGRESS)
how = rec.spec["data"]
if how.endswith("crash"):
    sys.exit(3)
# Each throttled step lasts 1.2 s: the telemetry test needs one 0.25 s telemetry tick to carry
# a throttled step, and a suite run on a loaded 2-core host once had none carry it while the
# two steps lasted 0.45 s each (0.9 s).
for step, gov, duty in [(1, "NORMAL", 1.0), (2, "THROTTLED", 0.4), (3, "THROTTLED", 0.3),
                        (4, "NORMAL", 1.0)]:
    s.set_progress(jid, {"id": jid, "stage": "finetune", "step": step, "total": 4,
                         "pct": 25.0 * step, "detail": {"loss": 1.0, "governor": gov,
                         "duty": duty, "temp_c": 71.5, "limit": "thermal"}})
    time.sleep(1.2 if gov == "THROTTLED" else 0.45)
model = {"name": "digits", "version": "1+ft", "slot": "b"}
prev = {"name": "digits", "version": "1"}
if how.endswith("commit"):
    s.transition(jid, JobState.SUCCEEDED, result={
        "outcome": "committed", "metrics_before": {"eval/acc": 0.8},
        "metrics_after": {"eval/acc": 0.9}, "model": model, "previous_model": prev})
else:
    s.transition(jid, JobState.FAILED, error={"code": "JOB_FAILED", "message": "health: acc",
                 "retryable": False}, result={"outcome": "rolled_back", "reason": "acc dropped",
                 "model": prev, "previous_model": prev})
"""


@pytest.fixture
def daemon(tmp_path: Path, mosquitto: Callable[..., Broker]) -> Iterator[tuple[Daemon, Broker]]:
    broker = mosquitto()
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    for name in ("commit", "rollback", "crash"):  # the data sets the jobs name (data_root)
        (tmp_path / "state" / "data" / name).mkdir(parents=True)
    cfg = AgentConfig.model_validate({
        "device_id": "dev-a", "state_dir": str(tmp_path / "state"), "sensors": "sim",
        "socket_group": None, "telemetry_s": 0.25,
        "mqtt": broker.agent_mqtt(),
        "limits": {"max_job_attempts": 1, "progress_interval_s": 0.1}})
    d = Daemon(cfg, worker_argv=lambda jid: [sys.executable, str(script), str(cfg.state_dir),
                                             jid])
    t = threading.Thread(target=d.run)
    t.start()
    assert d.link.wait_connected(10)
    # Connected is not yet subscribed: its retained online status follows the SUBSCRIBE on the
    # daemon's connection, so once it is seen a command sent now is delivered.
    online = Peer(broker).subscribe(T.status("dev-a"))
    online.wait_for(lambda m: m.topic == T.status("dev-a") and m.json()["state"] == "online")
    online.close()
    yield d, broker
    d.stop_event.set()
    t.join(30)


def _job(data: str) -> dict:
    return command("finetune", args={"model": "digits", "data": data})


def test_events_from_job_outcomes_governor_and_crashes(daemon: tuple[Daemon, Broker]) -> None:
    _, broker = daemon
    fleet = Peer(broker).subscribe(T.all_events(), T.result("dev-a"))
    commit, rollback, crash = _job("commit"), _job("rollback"), _job("crash")
    for c in (commit, rollback, crash):
        fleet.publish(T.command("dev-a", "finetune"), c)

    def events(kind: str, count: int = 1) -> list[dict]:
        got = fleet.wait_for(lambda m: m.topic == T.event("dev-a", kind), count=count,
                             timeout_s=30)
        return [Event.from_payload(m.payload).model_dump(mode="json") for m in got]

    committed = events("model_committed")[0]
    assert committed["device"] == "dev-a" and committed["data"]["job_id"] == commit["id"]
    assert committed["data"]["model"]["version"] == "1+ft"
    assert committed["data"]["metrics_after"] == {"eval/acc": 0.9}
    rolled = events("model_rolled_back")[0]
    assert rolled["data"]["job_id"] == rollback["id"] and rolled["data"]["status"] == "FAILED"
    assert rolled["data"]["reason"] == "acc dropped"
    # The governor's state changes, per job: NORMAL -> THROTTLED -> NORMAL (the first NORMAL
    # and the repeated THROTTLED are not changes).
    throttle = events("throttle", count=4)
    for job in (commit, rollback):
        mine = [e["data"] for e in throttle if e["data"]["job_id"] == job["id"]]
        assert [(e["previous"], e["state"]) for e in mine] == [
            ("NORMAL", "THROTTLED"), ("THROTTLED", "NORMAL")], mine
        assert mine[0]["reason"] == "thermal" and mine[0]["duty"] == 0.4
    err = events("error")[0]["data"]
    assert err["job_id"] == crash["id"] and err["exit_code"] == 3 and err["crashes"] == 1
    # Each event once, seq strictly increasing across kinds.
    time.sleep(0.5)
    allev = [m.json() for m in fleet.matching(lambda m: "/evt/" in m.topic)]
    assert len(allev) == 7, [(e["kind"], e["data"].get("job_id")) for e in allev]
    seqs = [e["seq"] for e in allev]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    fleet.close()


def test_telemetry_every_telemetry_s_qos0_with_expiry(daemon: tuple[Daemon, Broker]) -> None:
    _, broker = daemon
    fleet = Peer(broker).subscribe(T.telemetry("dev-a"), qos=1)
    job = _job("commit")
    fleet.publish(T.command("dev-a", "finetune"), job)
    got = fleet.wait_for(lambda m: m.topic == T.telemetry("dev-a"), count=10, timeout_s=10)
    assert all(m.qos == 0 and not m.retain for m in got)  # QoS 0 even to a QoS 1 subscriber
    assert all(m.expiry_s is not None and 0 < m.expiry_s <= TELEMETRY_EXPIRY_S for m in got)
    msgs = [Telemetry.from_payload(m.payload) for m in got]
    seqs = [t.seq for t in msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    gaps = [b.at - a.at for a, b in itertools.pairwise(got)]
    assert 0.15 < sorted(gaps)[len(gaps) // 2] < 0.4, gaps  # median ~ telemetry_s = 0.25
    # Sensor readings (the simulated board) and, while the job runs, its progress and the
    # governor state it reports: every message until the job has reported a throttled step
    # (on a loaded machine the job's first step can come after the first ten messages).
    def throttled_step(m: Any) -> bool:
        t = Telemetry.from_payload(m.payload)
        return bool(t.job and t.job.step is not None and t.job.pct and t.governor
                    and t.governor.state == "THROTTLED")

    fleet.wait_for(lambda m: m.topic == T.telemetry("dev-a") and throttled_step(m),
                   timeout_s=30)
    msgs = [Telemetry.from_payload(m.payload)
            for m in fleet.matching(lambda m: m.topic == T.telemetry("dev-a"))]
    assert all(t.temps_c and t.power_mw is not None and t.gpu_util is not None for t in msgs)
    during = [t for t in msgs if t.job is not None and t.job.step is not None]
    assert during and all(t.job.id == job["id"] and t.job.stage == "finetune" for t in during)
    assert {t.governor.state for t in during if t.governor} <= {"NORMAL", "THROTTLED"}
    assert any(t.governor and t.governor.state == "THROTTLED" and t.job.pct for t in during)
    fleet.close()


def test_telemetry_carries_what_the_application_serves(daemon: tuple[Daemon, Broker]) -> None:
    """Two processes serving digits (their stats files, ``agent.runtime.stats``): telemetry
    sums their counts and carries the worst p99; a stale file (a process gone) counts not."""
    from agent.runtime.stats import ServingStats, write_stats

    d, broker = daemon
    fleet = Peer(broker).subscribe(T.telemetry("dev-a"), qos=1)

    def stats(pid: int, p99: float, requests: int, updated: float) -> ServingStats:
        return ServingStats(model="digits", version="1+ft", pid=pid, updated=updated,
                            window_s=5.0, window_requests=40, p50_ms=p99 / 3, p99_ms=p99,
                            requests=requests, failed=1, slo_ms=25.0)

    write_stats(d.cfg.state_dir, stats(999_999, 500.0, 7, time.time() - 60))  # long gone
    end = time.monotonic() + 3
    while time.monotonic() < end:
        for pid, p99, n in ((101, 12.0, 100), (102, 30.0, 50)):
            write_stats(d.cfg.state_dir, stats(pid, p99, n, time.time()))
        time.sleep(0.2)
    got = fleet.wait_for(lambda m: m.topic == T.telemetry("dev-a")
                         and Telemetry.from_payload(m.payload).serving is not None, timeout_s=5)
    serving = Telemetry.from_payload(got[-1].payload).serving
    assert serving is not None and set(serving) == {"digits"}
    info = serving["digits"]
    assert (info.processes, info.requests, info.failed, info.window_requests) == (2, 150, 2, 80)
    assert info.p99_ms == 30.0 and info.p50_ms == 10.0 and info.slo_ms == 25.0
    assert info.version == "1+ft"
    fleet.close()
