"""What the daemon keeps is bounded: pruning finished jobs with their folders, logs, ledger rows
and crash counters (never an unfinished job); refusing response topics it would store; the
state dir made private. In this process, no broker: ``Daemon`` is built, never run."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from agent.daemon.config import AgentConfig
from agent.daemon.main import Daemon
from agent.jobs.store import JobState
from agent.mqtt.link import Inbound
from contract import Result, Topics
from tests.agent.daemon.conftest import command

T = Topics()


def _daemon(tmp_path: Path, **limits: object) -> tuple[Daemon, list[Result]]:
    cfg = AgentConfig.model_validate({
        "device_id": "dev-a", "state_dir": str(tmp_path / "state"), "sensors": "none",
        "socket_group": None, "limits": {"keep_finished_jobs": 10, "keep_command_records": 10,
                                         **limits}})
    d = Daemon(cfg)
    seen: list[Result] = []
    d.ann.listen(seen.append)
    d.ann._flush = lambda: None  # nothing to publish to
    return d, seen


def test_prune_drops_old_jobs_with_their_files_but_never_an_unfinished_one(
    tmp_path: Path,
) -> None:
    d, _ = _daemon(tmp_path)
    state = d.cfg.state_dir
    d.store.submit("running", "finetune", {})
    d.store.transition("running", JobState.IN_PROGRESS)
    for i in range(15):
        jid = f"done{i:02d}"
        d.store.submit(jid, "finetune", {})
        d.store.transition(jid, JobState.IN_PROGRESS)
        d.store.transition(jid, JobState.FAILED, error={"code": "JOB_FAILED", "message": "x"})
        d.ann.announce_job(d.store.get(jid))  # type: ignore[arg-type]
        (state / "jobs" / jid).mkdir(parents=True)
        (state / "logs").mkdir(exist_ok=True)
        (state / "logs" / f"{jid}.log").write_text("log")
        d._count_crash(jid)
    for _ in range(25):
        d.handler.handle(json.dumps(command("ping")).encode(), "ping")
    assert d.prune() == 5
    kept = {r.id for r in d.store.list(limit=100)}
    assert kept == {"running"} | {f"done{i:02d}" for i in range(5, 15)}
    assert sorted(p.name for p in (state / "jobs").iterdir()) == sorted(kept - {"running"})
    assert not (state / "logs" / "done00.log").exists() and (state / "logs/done14.log").exists()
    q = d.outbox.query
    assert q("SELECT COUNT(*) FROM commands")[0][0] == 10
    assert q("SELECT COUNT(*) FROM announced WHERE id='done00'")[0][0] == 0
    assert q("SELECT COUNT(*) FROM announced WHERE id='done14'")[0][0] > 0
    assert q("SELECT COUNT(*) FROM counters WHERE name='crash:done00'")[0][0] == 0
    assert q("SELECT COUNT(*) FROM counters WHERE name='crash:done14'")[0][0] == 1
    # By age: everything finished before now goes; the running job stays.
    d.cfg.limits.keep_history_s = 1e-3
    time.sleep(0.01)
    d.prune()
    assert {r.id for r in d.store.list(limit=100)} == {"running"}
    d.outbox.close()


def test_response_topics_and_correlation_data_are_bounded(tmp_path: Path) -> None:
    d, seen = _daemon(tmp_path, max_response_topic_bytes=64, max_correlation_bytes=16)
    cases = [("x" * 65, b"c", "response topic is 65 bytes"),
             ("replies/+", b"c", "no + # or NUL"),
             ("replies/ok", b"c" * 17, "correlation data is 17 bytes")]
    for topic, corr, why in cases:
        ping = command("ping")
        d._on_inbound(Inbound(T.command("dev-a", "ping"), json.dumps(ping).encode(), topic, corr))
        r = seen[-1]
        assert r.id == ping["id"] and r.status == "REJECTED" and why in r.error.message  # type: ignore[union-attr]
    # Nothing was queued for the oversized topic: only the device's own result topic.
    topics = {m.topic for m in d.outbox.pending()}
    assert topics == {T.result("dev-a")}
    ok = command("ping")
    d._on_inbound(Inbound(T.command("dev-a", "ping"), json.dumps(ok).encode(), "replies/ok",
                          b"c"))
    assert seen[-1].status == "SUCCEEDED"
    assert "replies/ok" in {m.topic for m in d.outbox.pending()}
    d.outbox.close()


def test_the_state_dir_is_made_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / "jobs.db").touch(mode=0o644)
    old = os.umask(0)
    try:
        d, _ = _daemon(tmp_path)
        d.store.submit("j", "finetune", {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for name in ("jobs.db", "agent.db"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    d.outbox.close()


def test_config_paths_are_absolute_and_settings_come_from_it(tmp_path: Path,
                                                             monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = AgentConfig.model_validate({"device_id": "d", "state_dir": "state",
                                      "data_root": "data", "registry": {"url": "/r"}})
    s = cfg.job_settings()
    assert s.state_dir == tmp_path / "state" and s.data_root == tmp_path / "data"
    assert s.trusted_keys == tmp_path / "state/trusted_keys"
    assert s.signing_key == tmp_path / "state/device.key.pem"
    assert cfg.socket_path == tmp_path / "state/agent.sock"
    assert cfg.limits.max_queued_jobs == 16


def test_a_record_from_before_ids_were_checked_never_names_a_file_to_delete(
    tmp_path: Path,
) -> None:
    d, _ = _daemon(tmp_path)
    state = d.cfg.state_dir
    (state / "jobs").mkdir()
    for jid in ["..", "../..", "."] + [f"r{i:02d}" for i in range(12)]:
        d.store.reject(jid, "finetune", {"code": "BAD_ARGS", "message": "x"}, source="mqtt")
    assert d.prune() == 5
    assert state.is_dir() and (state / "jobs.db").is_file() and (state / "jobs").is_dir()
    d.outbox.close()


def test_check_files_names_each_loose_secret_and_writable_trust_root(tmp_path: Path) -> None:
    ca, key, pw = tmp_path / "ca.crt", tmp_path / "device.key", tmp_path / "pw"
    for f, mode in ((ca, 0o664), (key, 0o640), (pw, 0o600)):
        f.write_text("x")
        f.chmod(mode)
    trusted = tmp_path / "trusted"
    trusted.mkdir(mode=0o777)
    trusted.chmod(0o777)
    cfg = AgentConfig.model_validate({
        "device_id": "d", "state_dir": str(tmp_path / "state"),
        "mqtt": {"password_file": str(pw), "tls": {"ca": str(ca), "cert": str(ca),
                                                   "key": str(key)}},
        "registry": {"trusted_keys": str(trusted)}})
    problems = "\n".join(cfg.check_files())
    assert f"mqtt.tls.key: secret {key} is open to group or others" in problems
    assert f"mqtt.tls.ca: CA bundle {ca} is writable by group or others" in problems
    assert f"registry.trusted_keys: trusted-keys folder {trusted} is writable" in problems
    assert "password_file" not in problems
