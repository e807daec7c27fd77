"""Staged rollouts end to end: the real ``fleetctl`` against a real mosquitto and simulated
devices that speak the agent's contract."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc

from fleet.db import Database, is_url
from fleet.rollout.store import FleetStore
from fleet.sim.fleet import SimFleet
from tests.fleet.conftest import BOTH_ENGINES, fleetctl_argv
from tests.support.waiting import until

Run = Callable[..., subprocess.CompletedProcess[str]]


def report(tmp_path: Path, rid: str) -> dict[str, Any]:
    return json.loads((tmp_path / "reports" / f"{rid}.json").read_text())


def rollout_id(out: str) -> str:
    return json.loads(out.splitlines()[0])["rollout"]


def jobs_run(fleet: SimFleet, rep: dict[str, Any]) -> dict[str, list[str]]:
    """Per device, the ids of this rollout's jobs it started (rollbacks excluded)."""
    key = rep["key"] + "."
    return {d.id: [j for j in d.executed if j.startswith(key) and "rollback" not in j]
            for d in fleet.devices.values()}


def test_100_devices_roll_out_in_waves(sim_fleet: Callable[..., SimFleet], fleetctl: Run,
                                       tmp_path: Path) -> None:
    fleet = sim_fleet(devices=100, behavior={"job_duration_s": 0.1, "acc_delta": 0.01})
    r = fleetctl("rollout", "create", "--name", "deploy-v2", "--group", "sim", "--job",
                 "deploy", "--args", '{"version": "v2"}', "--waves", "1,5%,25%,100%",
                 "--bake-s", "0.3", "--max-metric-drop", "0.02", "--min-completed", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(tmp_path, "deploy-v2")
    assert rep["state"] == "succeeded"
    assert [w["devices"] for w in rep["waves"]] == [1, 4, 20, 75]
    assert all(w["succeeded"] == w["devices"] and w["state"] == "done" for w in rep["waves"])
    jobs = [e for e in rep["executions"] if e["kind"] == "job"]
    assert len(jobs) == 100 and {e["status"] for e in jobs} == {"SUCCEEDED"}
    # Each wave starts after the previous one finished and baked.
    for prev, nxt in zip(rep["waves"], rep["waves"][1:], strict=False):
        first_sent = min(e["sent_at"] for e in jobs if e["wave"] == nxt["wave"])
        assert first_sent >= prev["finished_at"] >= prev["started_at"] + 0.3 - 1e-3
    for d, runs in jobs_run(fleet, rep).items():
        assert runs == [f"{rep['key']}.{d}.1"]
    assert {d.model.version for d in fleet.devices.values()} == {"v2"}
    assert (tmp_path / "reports" / "deploy-v2.png").read_bytes()[:4] == b"\x89PNG"
    assert "deploy-v2: succeeded" in r.stdout


def test_20_percent_failing_aborts_after_first_wave_and_rolls_back(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, tmp_path: Path
) -> None:
    # Every 5th device fails: sim-0004 is in the first wave after the canary (devices 1-4).
    fleet = sim_fleet(devices=100, fail_share=0.2, behavior={"job_duration_s": 0.1})
    r = fleetctl("rollout", "create", "--name", "bad", "--group", "sim", "--job", "deploy",
                 "--args", '{"version": "v2"}', "--waves", "1,5%,25%,100%", "--bake-s", "0.2",
                 "--abort-failure-rate", "0.1", "--min-completed", "5")
    assert r.returncode == 1, r.stdout + r.stderr
    rep = report(tmp_path, "bad")
    assert rep["state"] == "aborted" and rep["reason"].startswith("failure rate 1/5")
    assert [w["state"] for w in rep["waves"]] == ["done", "aborted", "pending", "pending"]
    ran = {d for d, runs in jobs_run(fleet, rep).items() if runs}
    assert ran == {f"sim-{i:04d}" for i in range(5)}  # nothing beyond wave 1 was sent
    # The four that committed v2 are rolled back to v1; the failed one never changed.
    assert rep["rolled_back"] == 4
    assert {d.id for d in fleet.devices.values() if any("rollback" in j for j in d.executed)} \
        == {"sim-0000", "sim-0001", "sim-0002", "sim-0003"}
    assert {d.model.version for d in fleet.devices.values()} == {"v1"}


def test_canary_accuracy_drop_aborts(sim_fleet: Callable[..., SimFleet], fleetctl: Run,
                                     tmp_path: Path) -> None:
    fleet = sim_fleet(devices=10, behavior={"job_duration_s": 0.05, "acc_delta": 0.005},
                      overrides={"sim-0000": {"job_duration_s": 0.05, "acc_delta": -0.05}})
    r = fleetctl("rollout", "create", "--name", "canary", "--group", "sim", "--job",
                 "finetune", "--waves", "1,50%,100%", "--max-metric-drop", "0.02")
    assert r.returncode == 1, r.stdout + r.stderr
    rep = report(tmp_path, "canary")
    assert rep["state"] == "aborted"
    assert "wave 0: median eval/acc drop 0.0500 > 0.02" in rep["reason"]
    assert [d for d, runs in jobs_run(fleet, rep).items() if runs] == ["sim-0000"]
    assert fleet.devices["sim-0000"].model.version == "v1"  # rolled back
    assert rep["rolled_back"] == 1


def _db_count(db: str | Path, where: str) -> int:
    if not is_url(db) and not Path(db).exists():
        return 0
    d = Database(db)
    try:
        return int(d.scalar(f"SELECT COUNT(*) FROM executions WHERE {where}") or 0)
    except (sa_exc.OperationalError, sa_exc.ProgrammingError):
        return 0  # not created yet (no such table)
    finally:
        d.close()


@BOTH_ENGINES
def test_controller_sigkilled_mid_rollout_resumes_without_running_anything_twice(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, broker: Any, tmp_path: Path,
    subprocess_env: dict[str, str], fleet_db: str,
) -> None:
    # SQLite: the one controller's persistent session keeps the results sent while it is
    # down. PostgreSQL: the next replica waits out the dead one's lease, then re-sends what
    # was open and the devices answer DUPLICATE with where they stand. A job outlasts the
    # controller's absence (the 0.6 s below and its next start-up, ~1-2 s on a busy 2-core
    # host): with 1 s jobs a slow restart once found every job already answered, nothing open
    # to re-send, and so no DUPLICATE to count.
    fleet = sim_fleet(devices=60, behavior={"job_duration_s": 4.0})
    db = fleet_db
    base = [*fleetctl_argv(broker, tmp_path, fleet_db), "--lease-s", "2"]
    create = [*base, "rollout", "create", "--name", "kill", "--group", "sim", "--job",
              "deploy", "--args", '{"version": "v2"}', "--waves", "1,20%,100%",
              "--bake-s", "0.2", "--max-per-minute", "3000"]
    for kill_at in (3, 30):  # in the first waves, then in the middle of the last one
        argv = create if kill_at == 3 else [*base, "controller"]
        proc = subprocess.Popen(argv, env=subprocess_env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while _db_count(db, "status != 'PLANNED'") < kill_at or _db_count(
                db, "status IN ('SENT', 'ACCEPTED', 'IN_PROGRESS')") == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "finished too early"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.6)  # results arrive while no controller runs: the session keeps them
    r = fleetctl("--lease-s", "2", "controller")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(tmp_path, "kill")
    assert rep["state"] == "succeeded"
    jobs = [e for e in rep["executions"] if e["kind"] == "job"]
    assert len(jobs) == 60 and {e["status"] for e in jobs} == {"SUCCEEDED"}
    assert {e["attempt"] for e in jobs} == {1}
    for dev, runs in jobs_run(fleet, rep).items():
        assert runs == [f"{rep['key']}.{dev}.1"], (dev, runs)  # started once, never again
    assert sum(d.duplicates for d in fleet.devices.values()) > 0  # re-sent, answered DUPLICATE


@BOTH_ENGINES
def test_offline_device_times_out_and_rejected_is_not_retried(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, tmp_path: Path
) -> None:
    fleet = sim_fleet(devices=4, behavior={"job_duration_s": 0.05},
                      overrides={"sim-0001": {"reject": True}})
    fleet.crash("sim-0002")  # its last will marks it offline; commands wait in its session
    time.sleep(0.2)
    r = fleetctl("rollout", "create", "--name", "offline", "--group", "sim", "--job", "deploy",
                 "--timeout-s", "1", "--retries", "1", "--abort-failure-rate", "1")
    assert r.returncode == 1, r.stdout + r.stderr  # finished, but not every device succeeded
    rep = report(tmp_path, "offline")
    by_dev: dict[str, list[dict[str, Any]]] = {}
    for e in rep["executions"]:
        if e["kind"] == "job":
            by_dev.setdefault(e["device"], []).append(e)
    assert [e["status"] for e in by_dev["sim-0001"]] == ["REJECTED"]
    assert [e["status"] for e in by_dev["sim-0002"]] == ["TIMED_OUT", "TIMED_OUT"]
    assert [e["status"] for e in by_dev["sim-0000"]] == ["SUCCEEDED"]
    assert rep["state"] == "completed_with_failures" and rep["waves"][0]["failed"] == 2


@BOTH_ENGINES
def test_a_rollout_with_a_failed_device_never_says_succeeded(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, tmp_path: Path
) -> None:
    # One device of three fails; under min_completed (5) the failure rate never aborts, so
    # the rollout runs to its end: it must say that a device failed, not "succeeded".
    sim_fleet(devices=3, behavior={"job_duration_s": 0.05},
              overrides={"sim-0001": {"job_duration_s": 0.05, "fail": True}})
    r = fleetctl("rollout", "create", "--name", "partial", "--group", "sim", "--job", "deploy",
                 "--args", '{"version": "v2"}')
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == "rollout partial: completed_with_failures (1 of 3 devices failed)"
    assert "succeeded" not in lines[1] and "partial: succeeded" not in r.stdout
    assert "failed devices (1):" in lines
    row = next(x for x in lines if x.startswith("sim-0001 "))
    assert row.split()[:5] == ["sim-0001", "0", "1", "FAILED", "JOB_FAILED"]
    assert row.endswith("step deploy: simulated failure")
    rep = report(tmp_path, "partial")
    assert rep["state"] == "completed_with_failures" and rep["finished_at"] is not None
    assert [(f["device"], f["status"], f["code"], f["message"]) for f in rep["failures"]] \
        == [("sim-0001", "FAILED", "JOB_FAILED", "step deploy: simulated failure")]
    txt = (tmp_path / "reports" / "partial.txt").read_text()
    assert txt.splitlines()[0] == lines[1]
    listed = fleetctl("rollout", "list", "--json")
    assert [(x["id"], x["state"]) for x in json.loads(listed.stdout)] \
        == [("partial", "completed_with_failures")]
    # Every device succeeding is still "succeeded", exit 0.
    ok = fleetctl("rollout", "create", "--name", "whole", "--devices", "sim-0000,sim-0002",
                  "--job", "deploy", "--args", '{"version": "v2"}')
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[1] == "rollout whole: succeeded"
    assert "failed devices" not in ok.stdout


def test_rollout_status_names_each_failed_device_and_its_reason(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, tmp_path: Path
) -> None:
    # Four ways to fail: FAILED by the job, REJECTED at once, no reply at all (offline: our
    # own timeout), and the device's own gates rolling the new model back.
    fleet = sim_fleet(devices=5, behavior={"job_duration_s": 0.05},
                      overrides={"sim-0001": {"job_duration_s": 0.05, "fail": True},
                                 "sim-0002": {"reject": True},
                                 "sim-0004": {"job_duration_s": 0.05, "gate_rollback": True}})
    fleet.crash("sim-0003")
    time.sleep(0.2)
    r = fleetctl("rollout", "create", "--name", "why", "--group", "sim", "--job", "deploy",
                 "--args", '{"version": "v2"}', "--timeout-s", "1", "--abort-failure-rate", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    st = fleetctl("rollout", "status", "why")
    assert st.returncode == 1, st.stdout + st.stderr
    lines = st.stdout.splitlines()
    assert lines[0] == "rollout why: completed_with_failures (4 of 5 devices failed)"
    i = lines.index("failed devices (4):")
    assert lines[i + 1].split() == ["DEVICE", "WAVE", "ATTEMPT", "STATUS", "CODE", "MESSAGE"]
    rows = {x.split()[0]: x for x in lines[i + 2:]}
    assert set(rows) == {"sim-0001", "sim-0002", "sim-0003", "sim-0004"}
    want = {
        "sim-0001": (["FAILED", "JOB_FAILED"], "step deploy: simulated failure"),
        "sim-0002": (["REJECTED", "BAD_ARGS"], "args.version: simulated refusal"),
        "sim-0003": (["TIMED_OUT", "CONTROLLER_TIMEOUT"], "no terminal result within 1 s"),
        "sim-0004": (["ROLLED_BACK", "-"], "gate: accuracy below threshold"),
    }
    for dev, (cells, msg) in want.items():
        assert rows[dev].split()[3:5] == cells and rows[dev].endswith(msg), rows[dev]
    # --json carries the same, with the full message.
    js = fleetctl("rollout", "status", "why", "--json")
    s = json.loads(js.stdout)
    assert js.returncode == 1 and s["state"] == "completed_with_failures"
    assert {f["device"]: (f["status"], f["code"], f["message"]) for f in s["failures"]} == {
        dev: (cells[0], None if cells[1] == "-" else cells[1], msg)
        for dev, (cells, msg) in want.items()}


def test_pause_resume_abort_of_a_finished_rollout_say_so(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, tmp_path: Path
) -> None:
    sim_fleet(devices=2, behavior={"job_duration_s": 0.05})
    assert fleetctl("rollout", "create", "--name", "done", "--group", "sim", "--job",
                    "deploy", "--args", '{"version": "v2"}').returncode == 0
    for verb in ("pause", "resume", "abort"):
        r = fleetctl("rollout", verb, "done")
        assert r.returncode == 2, (verb, r.stdout, r.stderr)
        assert r.stdout == ""
        assert r.stderr.startswith("fleetctl: rollout done is already finished (succeeded at "), \
            r.stderr
        assert r.stderr.rstrip().endswith(f"Z): nothing to {verb}"), r.stderr
    with sqlite3.connect(tmp_path / "fleet.db", timeout=5) as c:
        assert c.execute("SELECT state, request FROM rollouts").fetchall() \
            == [("succeeded", None)]  # no request left behind for a controller
    st = fleetctl("rollout", "status", "done")
    assert st.returncode == 0 and st.stdout.splitlines()[0] == "rollout done: succeeded"


def test_bad_plan_is_refused_naming_the_field(fleetctl: Run, tmp_path: Path) -> None:
    bad = tmp_path / "rollout.yaml"
    bad.write_text("name: r\ngroup: sim\njob: deploy\nwaves: [1, 5%]\nbake: 600\n"
                   "max_metric_drop: -1\n")
    r = fleetctl("rollout", "create", "--plan", str(bad))
    assert r.returncode == 2
    assert "bake: unknown field" in r.stderr and "max_metric_drop:" in r.stderr
    r = fleetctl("rollout", "create", "--name", "r", "--group", "sim", "--job", "deploy",
                 "--abort-failure-rate", "2")
    assert r.returncode == 2 and "abort_failure_rate:" in r.stderr
    assert not (tmp_path / "fleet.db").exists() or _db_count(tmp_path / "fleet.db", "1") == 0


@pytest.mark.parametrize("wait", [True, False])
def test_send_to_group_and_device(sim_fleet: Callable[..., SimFleet], fleetctl: Run,
                                  wait: bool) -> None:
    sim_fleet(devices=5, overrides={"sim-0003": {"reject": True},
                                    "sim-0004": {"defer": 1, "defer_recheck_s": 30}})
    extra = ["--wait"] if wait else []
    r = fleetctl("send", "--group", "sim", "ping", *extra, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    want = {"SUCCEEDED"} if wait else {"ACCEPTED", "SUCCEEDED"}
    assert len(rows) == 5 and {x["status"] for x in rows} <= want
    r = fleetctl("send", "sim-0003", "deploy", "--args", '{"version": "v9"}', *extra)
    assert r.returncode == 1 and "BAD_ARGS" in r.stdout
    # A busy device's DEFERRED is its answer for now: shown with its recheck time, not done,
    # and not waited on past it (a rollout sends again; send does not).
    t0 = time.monotonic()
    r = fleetctl("send", "sim-0004", "deploy", "--args", '{"version": "v2"}', *extra,
                 "--timeout-s", "60")
    assert r.returncode == 1 and "DEFERRED" in r.stdout and "ask again in 30 s" in r.stdout, \
        r.stdout
    assert time.monotonic() - t0 < 50, "waited out the timeout on a DEFERRED answer"
    r = fleetctl("devices", "--json")
    assert [d["device"] for d in json.loads(r.stdout)] == [f"sim-{i:04d}" for i in range(5)]


def _state(db: str, rid: str) -> tuple[str, list[str]]:
    store = FleetStore(db)
    try:
        r = store.rollout(rid)
        assert r is not None
        return r.state, [w.state for w in store.waves(rid)]
    finally:
        store.close()


@BOTH_ENGINES
def test_operator_pause_resume_abort(sim_fleet: Callable[..., SimFleet], fleetctl: Run,
                                     broker: Any, tmp_path: Path,
                                     subprocess_env: dict[str, str], fleet_db: str) -> None:
    fleet = sim_fleet(devices=20, behavior={"job_duration_s": 0.05})
    db = fleet_db
    r = fleetctl("rollout", "create", "--detach", "--name", "ops", "--group", "sim",
                 "--job", "deploy", "--args", '{"version": "v2"}', "--waves", "1,50%,100%",
                 "--bake-s", "2.0")  # room for a fleetctl start on a loaded host
    assert r.returncode == 0, r.stderr
    assert _state(db, "ops") == ("running", ["pending"] * 3)  # created, nothing sent yet
    ctl = subprocess.Popen([*fleetctl_argv(broker, tmp_path, fleet_db), "controller"],
                           env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        until(lambda: _state(db, "ops")[1][0] == "baking", 30, "wave 1 baking")
        assert fleetctl("rollout", "pause", "ops").returncode == 0
        until(lambda: _state(db, "ops")[0] == "paused", 30, "the rollout paused")
        time.sleep(2.5)  # past the bake: a paused rollout starts no wave
        assert _state(db, "ops") == ("paused", ["done", "pending", "pending"])
        st = fleetctl("rollout", "status", "ops")
        assert "rollout ops: paused" in st.stdout and "[####################] 1/1" in st.stdout
        assert fleetctl("rollout", "resume", "ops").returncode == 0
        until(lambda: _state(db, "ops")[1][1] in ("baking", "done"), 30,
              "wave 2 baking or done")
        assert fleetctl("rollout", "abort", "ops").returncode == 0
        _, err = ctl.communicate(timeout=60)
    finally:
        ctl.kill()
    assert ctl.returncode == 1, err
    rep = report(tmp_path, "ops")
    assert rep["state"] == "aborted" and rep["reason"] == "operator abort"
    assert rep["waves"][2]["sent"] == 0 and rep["rolled_back"] == 10
    assert {d.model.version for d in fleet.devices.values()} == {"v1"}
    r = fleetctl("rollout", "resume", "ops")  # aborted is final: no controller would resume it
    assert r.returncode == 2 and "is already finished (aborted at " in r.stderr, r.stderr


def test_watch_follows_status_and_telemetry(sim_fleet: Callable[..., SimFleet], fleetctl: Run
                                            ) -> None:
    sim_fleet(devices=3, telemetry_s=0.2)
    r = fleetctl("watch", "--telemetry", "--count", "12", "--duration-s", "20")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 0 and len(lines) == 12
    status = [x for x in lines if x["kind"] == "status"]
    assert {x["device"] for x in status} == {"sim-0000", "sim-0001", "sim-0002"}
    assert {x["state"] for x in status} == {"online"}
    tel = [x for x in lines if x["kind"] == "telemetry"]
    assert len(tel) == 9 and all(x["temps_c"] == {"cpu": 45.0} for x in tel)


def test_device_gate_rollbacks_count_as_failures(sim_fleet: Callable[..., SimFleet],
                                                 fleetctl: Run, tmp_path: Path) -> None:
    # The devices' own gates refuse the model (JobOutcome.outcome = rolled_back): the job
    # "succeeded" but the fleet got nothing; the share of such devices aborts the rollout.
    sim_fleet(devices=10, behavior={"job_duration_s": 0.05, "gate_rollback": True})
    r = fleetctl("rollout", "create", "--name", "gates", "--group", "sim", "--job",
                 "finetune", "--waves", "2,100%", "--min-completed", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    rep = report(tmp_path, "gates")
    assert rep["state"] == "aborted" and rep["reason"].startswith("failure rate 2/2")
    assert rep["waves"][0]["failed"] == 2 and rep["rolled_back"] == 0  # nothing committed


@BOTH_ENGINES
def test_abort_cancels_queued_lets_running_finish_then_rolls_back(
    sim_fleet: Callable[..., SimFleet], fleetctl: Run, broker: Any, tmp_path: Path,
    subprocess_env: dict[str, str], fleet_db: str,
) -> None:
    # sim-0001 is busy with a long job of its own: the rollout's job waits in its queue
    # (ACCEPTED) while the other three run theirs.
    fleet = sim_fleet(devices=4, behavior={"job_duration_s": 1.0},
                      overrides={"sim-0001": {"job_duration_s": 8.0}})
    assert fleetctl("send", "sim-0001", "finetune").returncode == 0
    db = fleet_db
    assert fleetctl("rollout", "create", "--detach", "--name", "stop", "--group", "sim",
                    "--job", "deploy", "--args", '{"version": "v2"}').returncode == 0
    ctl = subprocess.Popen([*fleetctl_argv(broker, tmp_path, fleet_db), "controller"],
                           env=subprocess_env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        until(lambda: _db_count(db, "kind = 'job' AND status IN ('PLANNED', 'SENT')") == 0
              and _db_count(db, "device = 'sim-0001' AND status = 'ACCEPTED'") == 1, 30,
              "every job sent and sim-0001's accepted")
        assert fleetctl("rollout", "abort", "stop").returncode == 0
        _, err = ctl.communicate(timeout=60)
    finally:
        ctl.kill()
    rep = report(tmp_path, "stop")
    status = {e["device"]: e["status"] for e in rep["executions"] if e["kind"] == "job"}
    assert status == {"sim-0000": "SUCCEEDED", "sim-0001": "CANCELED",
                      "sim-0002": "SUCCEEDED", "sim-0003": "SUCCEEDED"}, err
    assert f"{rep['key']}.sim-0001.1" not in fleet.devices["sim-0001"].executed  # never ran
    assert rep["state"] == "aborted" and rep["rolled_back"] == 3
    assert {fleet.devices[d].model.version for d in ("sim-0000", "sim-0002", "sim-0003")} \
        == {"v1"}


def test_fleetctl_over_mutual_tls(mosquitto: Callable[..., Any], tmp_path: Path,
                                  subprocess_env: dict[str, str]) -> None:
    from fleet.mqtt import BrokerConfig
    from fleet.sim.config import SimConfig
    from tests.support.pki import make_pki

    pki = make_pki(tmp_path / "pki", ["sim-0000", "sim-0001", "ops"])
    # The certificate's CN is the account (no broker here is anonymous).
    b = mosquitto(tls=pki, require_certificate=True, use_identity_as_username=True)
    fleets = []
    for i, dev in enumerate(("sim-0000", "sim-0001")):  # each device its own certificate
        cert, key = pki.client(dev)
        cfg = BrokerConfig(host=b.host, port=b.port, tls_ca=pki.ca_cert, tls_cert=cert,
                           tls_key=key)
        fleets.append(SimFleet(SimConfig(devices=1, first_index=i), cfg).start())
    try:
        cert, key = pki.client("ops")
        tls = ["--host", b.host, "--port", str(b.port), "--tls-ca", str(pki.ca_cert),
               "--tls-cert", str(cert), "--tls-key", str(key), "--settle-s", "0.3"]
        r = subprocess.run([sys.executable, "-m", "fleet.cli", *tls, "send", "--group", "sim",
                            "ping", "--wait", "--json"], capture_output=True, text=True,
                           env=subprocess_env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert [x["device"] for x in json.loads(r.stdout)["results"]] == ["sim-0000", "sim-0001"]
        # No client certificate: the broker refuses the handshake; fleetctl says so, exit 1.
        r = subprocess.run([sys.executable, "-m", "fleet.cli", "--host", b.host, "--port",
                            str(b.port), "--tls-ca", str(pki.ca_cert), "--connect-timeout-s",
                            "2", "devices"],
                           capture_output=True, text=True, env=subprocess_env, timeout=60)
        assert r.returncode == 1
        assert "unreachable" in r.stderr or "no CONNACK" in r.stderr, r.stderr
    finally:
        for f in fleets:
            f.stop()


def test_same_rollout_name_in_a_fresh_db_runs_again(sim_fleet: Callable[..., SimFleet],
                                                     fleetctl: Run, tmp_path: Path) -> None:
    # Execution ids carry a nonce drawn at creation: the devices' stored ids of the first
    # rollout are not answered DUPLICATE to the second.
    fleet = sim_fleet(devices=3, behavior={"job_duration_s": 0.05})
    for version, db in (("v2", "a.db"), ("v3", "b.db")):
        r = fleetctl("--db", str(tmp_path / db), "rollout", "create", "--name", "same",
                     "--group", "sim", "--job", "deploy",
                     "--args", json.dumps({"version": version}))
        assert r.returncode == 0, r.stderr
    assert {d.model.version for d in fleet.devices.values()} == {"v3"}
    assert all(len(d.executed) == 2 and d.duplicates == 0 for d in fleet.devices.values())


@BOTH_ENGINES
def test_rollback_of_a_finished_rollout(sim_fleet: Callable[..., SimFleet], fleetctl: Run,
                                        tmp_path: Path) -> None:
    fleet = sim_fleet(devices=5, behavior={"job_duration_s": 0.05})
    assert fleetctl("rollout", "create", "--name", "undo", "--group", "sim", "--job", "deploy",
                    "--args", '{"version": "v2"}').returncode == 0
    assert {d.model.version for d in fleet.devices.values()} == {"v2"}
    r = fleetctl("rollout", "rollback", "undo")
    assert r.returncode == 0 and '"rolling_back"' in r.stdout
    r = fleetctl("controller")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report(tmp_path, "undo")
    assert rep["state"] == "rolled_back" and rep["rolled_back"] == 5
    assert {d.model.version for d in fleet.devices.values()} == {"v1"}


@pytest.mark.slow
def test_real_agents_in_a_100_device_rollout(
    sim_fleet: Callable[..., SimFleet], real_agents: Callable[..., list[Any]], fleetctl: Run,
    tmp_path: Path,
) -> None:
    # 97 simulated devices and 3 real edge-agent daemons running the real device job (pull,
    # fine-tune, stage, health, commit). Their ids sort last: they share the last wave.
    fleet = sim_fleet(devices=97, behavior={"job_duration_s": 0.1, "acc_delta": 0.01})
    reals = real_agents(["zreal-0", "zreal-1", "zreal-2"], ["sim"])
    # The data set by name: each daemon resolves it under its own data_root (agent.yaml).
    args = {"model": "digits", "data": "device.npz",
            # A fixed micro-batch skips the job's memory probes: the test is about the fleet.
            "finetune": {"steps": 2, "effective_batch": 16, "micro_batch": 16},
            "steps": {"export": False}}
    # The daemons take a moment to connect and publish their status.
    until(lambda: "zreal-2" in fleetctl("devices", "--group", "sim").stdout, 60,
          "zreal-2 listed online")
    r = fleetctl("rollout", "create", "--name", "mixed", "--group", "sim", "--job", "finetune",
                 "--args", json.dumps(args), "--waves", "1,5%,25%,100%", "--bake-s", "0.2",
                 "--max-metric-drop", "0.05", "--timeout-s", "400", timeout=500)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = report(tmp_path, "mixed")
    jobs = {e["device"]: e for e in rep["executions"] if e["kind"] == "job"}
    assert len(jobs) == 100 and {e["status"] for e in jobs.values()} == {"SUCCEEDED"}
    for a in reals:
        e = jobs[a.device_id]
        assert e["wave"] == 3 and e["outcome"] == "committed" and e["metric_before"] is not None
        assert a.jobs() == [(f"{rep['key']}.{a.device_id}.1", "finetune", "SUCCEEDED")]
    assert all(len(d.executed) == 1 for d in fleet.devices.values())
    # The operator takes it back: every device, real ones included, returns to digits@1.
    assert fleetctl("rollout", "rollback", "mixed").returncode == 0
    r = fleetctl("controller", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = report(tmp_path, "mixed")
    assert rep["state"] == "rolled_back" and rep["rolled_back"] == 100
    for a in reals:
        assert [j[1:] for j in a.jobs()] == [("finetune", "SUCCEEDED"), ("rollback", "SUCCEEDED")]
    assert {d.model.version for d in fleet.devices.values()} == {"v1"}
