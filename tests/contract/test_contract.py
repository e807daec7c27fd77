"""The MQTT contract: topics round-trip, commands are validated at the boundary with a code."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from contract import (
    MAX_PAYLOAD_BYTES,
    Command,
    CommandRejected,
    JobOutcome,
    Result,
    Status,
    Topics,
    parse_command,
    utc_now,
)


def _cmd(**over: object) -> bytes:
    body: dict[str, object] = {
        "v": 1,
        "id": "c-1",
        "type": "ping",
        "issued_at": "2026-11-23T05:31:00Z",
        "args": {},
    }
    body.update(over)
    return json.dumps(body).encode()


def test_contract_imports_neither_torch_nor_paho() -> None:
    code = (
        "import sys, contract; "
        "assert 'torch' not in sys.modules and 'paho' not in sys.modules; "
        "side = {'agent', 'fleet', 'hpc_core', 'exporters', 'registry'}; "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in side); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_topics_build_and_parse() -> None:
    t = Topics("fleet/v1")
    assert t.command("dev-1", "ping") == "fleet/v1/dev/dev-1/cmd/ping"
    assert t.parse(t.command("dev-1", "ping")) == ("cmd", "dev-1", "ping")
    assert t.parse(t.group_command("lab", "finetune")) == ("group_cmd", "lab", "finetune")
    assert t.parse(t.status("d")) == ("status", "d", None)
    assert t.parse(t.event("d", "throttle")) == ("evt", "d", "throttle")
    for bad in ("other/dev/d/status", "fleet/v1/dev/d", "fleet/v1/x/d/cmd/ping"):
        with pytest.raises(ValueError):
            t.parse(bad)
    with pytest.raises(ValueError, match="prefix"):
        Topics("fleet/#")


def test_valid_command_round_trips_in_utc() -> None:
    cmd = parse_command(_cmd(issued_at="2026-11-23T07:31:00+02:00"), "ping")
    assert cmd.issued_at == datetime(2026, 11, 23, 5, 31, tzinfo=timezone.utc)
    again = json.loads(cmd.to_payload())
    assert again["issued_at"] == "2026-11-23T05:31:00.000Z"
    assert Command.from_payload(cmd.to_payload()) == cmd


@pytest.mark.parametrize(
    ("payload", "topic_type", "code", "names"),
    [
        (b"\xff\xfe", "ping", "BAD_JSON", "UTF-8"),
        (b"[1, 2]", "ping", "BAD_JSON", "object"),
        (b"[" * 5000, "ping", "BAD_JSON", "JSON"),
        (_cmd(), "reboot", "UNKNOWN_TYPE", "reboot"),
        (_cmd(v=2), "ping", "UNSUPPORTED_VERSION", "v=2"),
        (_cmd(id=""), "ping", "BAD_ENVELOPE", "id"),
        (_cmd(issued_at="yesterday"), "ping", "BAD_ENVELOPE", "issued_at"),
        (_cmd(issued_at="2026-11-23T05:31:00"), "ping", "BAD_ENVELOPE", "UTC offset"),
        (_cmd(extra=1), "ping", "BAD_ENVELOPE", "extra"),
        (_cmd(type="status"), "ping", "TYPE_MISMATCH", "cmd/ping"),
        (_cmd(type="cancel", args={}), "cancel", "BAD_ARGS", "args.job_id"),
        (_cmd(type="set_power_mode", args={"mode": "15W", "x": 1}), "set_power_mode",
         "BAD_ARGS", "args.x"),
        (_cmd(expires_at="2020-01-01T00:00:00Z"), "ping", "EXPIRED", "expired"),
    ],
)
def test_bad_commands_are_rejected_with_a_code(
    payload: bytes, topic_type: str, code: str, names: str
) -> None:
    with pytest.raises(CommandRejected) as err:
        parse_command(payload, topic_type)
    assert err.value.code == code
    assert names in err.value.message


def test_rejection_keeps_a_readable_id_for_the_result() -> None:
    with pytest.raises(CommandRejected) as err:
        parse_command(_cmd(id="abc", v=9), "ping")
    assert err.value.command_id == "abc"
    with pytest.raises(CommandRejected) as err:
        parse_command(_cmd(id="a/b", v=9), "ping")
    assert err.value.command_id is None


def test_oversized_payload_is_rejected_before_parsing() -> None:
    big = _cmd(args={"pad": "x" * MAX_PAYLOAD_BYTES})
    with pytest.raises(CommandRejected) as err:
        parse_command(big, "ping")
    assert err.value.code == "TOO_LARGE"


def test_future_expiry_is_accepted() -> None:
    later = (utc_now() + timedelta(minutes=5)).isoformat()
    assert parse_command(_cmd(expires_at=later), "ping").expires_at is not None


def test_status_result_and_outcome_serialise() -> None:
    now = utc_now()
    st = Status(state="online", device="d1", conn_seq=3, boot_id="b", agent_version="0.1",
                groups=["lab"], ts=now)
    assert Status.from_payload(st.to_payload()).conn_seq == 3
    out = JobOutcome(outcome="committed", metrics_before={"eval/acc": 0.5},
                     metrics_after={"eval/acc": 0.9}, report="r.png")
    res = Result(id="c", device="d1", status="SUCCEEDED", seq=1, ts=now,
                 result=out.model_dump(exclude_none=True))
    back = Result.from_payload(res.to_payload())
    outcome = JobOutcome.model_validate(back.result)
    assert outcome.metric_drop("eval/acc") == pytest.approx(-0.4)
    assert outcome.metric_drop("missing") is None


@pytest.mark.parametrize("cid", ["..", ".", "-x", "--job-id=x", ".hidden", "a/b", "a b", "a\n",
                                 "x" * 129, "é", "a+b", "a#"])
def test_unsafe_command_ids_are_refused_and_never_used_as_a_key(cid: str) -> None:
    with pytest.raises(CommandRejected) as e:
        parse_command(_cmd(id=cid), "ping")
    assert e.value.code == "BAD_ENVELOPE" and e.value.command_id is None


@pytest.mark.parametrize("cid", ["c-1", "ft:2026-11-23T05.30_a", "9", "x" * 128])
def test_safe_command_ids(cid: str) -> None:
    assert parse_command(_cmd(id=cid), "ping").id == cid


def test_deferred_result_carries_a_bounded_recheck_time() -> None:
    from pydantic import ValidationError

    base = {"id": "c-1", "device": "d", "seq": 1, "ts": utc_now()}
    r = Result(status="DEFERRED", recheck_after_s=30, error={
        "code": "UNAVAILABLE", "message": "a finetune job is running", "retryable": True},
        **base)
    back = Result.from_payload(r.to_payload())
    assert back.status == "DEFERRED" and back.recheck_after_s == 30.0
    for bad, where in (({"status": "DEFERRED"}, "required on a DEFERRED"),
                       ({"status": "DEFERRED", "recheck_after_s": 0.5}, "recheck_after_s"),
                       ({"status": "DEFERRED", "recheck_after_s": 3601}, "recheck_after_s"),
                       ({"status": "ACCEPTED", "recheck_after_s": 10}, "only a DEFERRED")):
        with pytest.raises(ValidationError, match=where):
            Result(**base, **bad)  # type: ignore[arg-type]
    # A repeat of a deferred id is no DUPLICATE: DEFERRED is no terminal status.
    from contract import TERMINAL_STATUSES

    assert "DEFERRED" not in TERMINAL_STATUSES
