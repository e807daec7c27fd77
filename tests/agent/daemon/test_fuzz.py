"""5,000 random invalid payloads on the command topics: no crash, each REJECTED with a code.

How: all 5,000 go through the daemon's own inbound path in this process (``Daemon._on_inbound``:
topic parsing, validation, persistence, the outbox) — the path paho's ``on_message`` calls;
a representative 300 of them also go over a real mosquitto to a real ``edge-agent`` process,
which must answer each with REJECTED and still answer a ping afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.daemon.config import AgentConfig
from agent.daemon.main import Daemon
from agent.mqtt.link import Inbound
from contract import COMMAND_TYPES, MAX_PAYLOAD_BYTES, ErrorCode, Result, Topics
from tests.agent.daemon.conftest import AgentProc, command
from tests.support.mosquitto import Broker
from tests.support.mqtt import Peer

T = Topics()
CODES = set(ErrorCode.__args__)  # type: ignore[attr-defined]
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(
    max_size=20)
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=8), c, max_size=4), max_leaves=12)
topic_type = st.sampled_from([*COMMAND_TYPES, "reboot", "", "PING"])


@st.composite
def broken_envelope(draw: Any) -> tuple[str, bytes]:
    """A valid envelope with exactly one thing wrong, so it can never validate."""
    t = draw(st.sampled_from(COMMAND_TYPES))
    env = command(t, args={"job_id": "x"} if t == "cancel" else (
        {"mode": "15W"} if t == "set_power_mode" else {}))
    how = draw(st.sampled_from(["v", "id", "issued_at", "type", "args", "timeout", "extra",
                                "drop"]))
    if how == "v":
        env["v"] = draw(json_any.filter(lambda x: x != 1 or isinstance(x, bool)))
        if env["v"] is True:
            env["v"] = 2
    elif how == "id":
        env["id"] = draw(st.sampled_from(["", "a/b", "a+b", "#", "x" * 200]) | st.integers()
                         | st.lists(st.integers()))
    elif how == "issued_at":
        env["issued_at"] = draw(st.sampled_from(["2026-01-01T00:00:00", "yesterday", ""])
                                | st.lists(st.integers(), max_size=2))
    elif how == "type":
        env["type"] = draw(st.sampled_from([x for x in COMMAND_TYPES if x != t] + ["zap"]))
    elif how == "args":
        env["args"] = draw(st.dictionaries(st.text(min_size=1, max_size=8).filter(
            lambda k: k not in ("job_id", "mode", "name", "reason", "model", "data", "version")),
            json_any, min_size=1, max_size=3) | st.lists(json_any, max_size=2) | st.text())
        if t in ("finetune", "deploy") and isinstance(env["args"], dict):
            env["args"].pop("model", None)
    elif how == "timeout":
        env["timeout_s"] = draw(st.sampled_from([0, -1, "soon", [1]]))
    elif how == "extra":
        env[draw(st.sampled_from(["cmd", "Id", "token", "argz"]))] = draw(json_any)
    else:
        env.pop(draw(st.sampled_from(["v", "id", "type", "issued_at"])))
    return t, json.dumps(env).encode()


payloads = st.one_of(
    st.tuples(topic_type, st.binary(max_size=200).map(lambda b: b"\xff" + b)),
    st.tuples(topic_type, json_any.filter(lambda x: not isinstance(x, dict)).map(
        lambda x: json.dumps(x).encode())),
    st.tuples(topic_type, st.dictionaries(st.text(max_size=6), json_any, max_size=5).filter(
        lambda d: d.get("v") != 1).map(lambda d: json.dumps(d).encode())),
    broken_envelope(),
    st.tuples(topic_type, st.just(b"{" + b" " * MAX_PAYLOAD_BYTES + b"}")),
)


def _assert_rejected(r: Result) -> None:
    assert r.status in ("REJECTED", "EXPIRED"), r
    assert r.error is not None and r.error.code in CODES and r.error.message, r


def test_5000_payloads_through_the_inbound_path(tmp_path: Path) -> None:
    cfg = AgentConfig(device_id="dev-a", state_dir=tmp_path / "state", sensors="none",
                      socket_group=None)
    daemon = Daemon(cfg)
    seen: list[Result] = []
    daemon.ann.listen(seen.append)
    # paho would queue 5,000 results in memory while disconnected; this test reads them from
    # the listener instead.
    daemon.ann._flush = lambda: None

    @settings(max_examples=5000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(payloads)
    def one(case: tuple[str, bytes]) -> None:
        t, payload = case
        before = len(seen)
        daemon._on_inbound(Inbound(T.command("dev-a", t or "x"), payload, None, None))
        new = seen[before:]
        assert len(new) == 1, (payload[:200], new)
        _assert_rejected(new[0])

    one()
    assert len(seen) == 5000
    daemon.outbox.close()


def test_garbage_over_the_broker_then_still_alive(
    mosquitto: Callable[..., Broker], agent: Callable[..., AgentProc]
) -> None:
    broker = mosquitto()
    agent(broker)
    fleet = Peer(broker).subscribe(T.result("dev-a"))
    sent = []

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(payloads.filter(lambda c: len(c[1]) < 4096))
    def collect(case: tuple[str, bytes]) -> None:
        sent.append(case)

    collect()
    for t, payload in sent:
        fleet.publish(T.command("dev-a", t or "x"), payload, wait=False)
    got = fleet.wait_for(lambda m: True, count=len(sent), timeout_s=60)
    for m in got:
        _assert_rejected(Result.from_payload(m.payload))
    ping = command("ping")
    fleet.publish(T.command("dev-a", "ping"), ping)
    fleet.wait_for(lambda m: m.json()["id"] == ping["id"] and m.json()["status"] == "SUCCEEDED")
    fleet.close()
