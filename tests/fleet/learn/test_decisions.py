"""A round's decisions, rule by rule: which device uploads it combines and which it refuses
(``fleet.learn.updates``), when it aggregates or is skipped (``fleet.learn.quorum``), which
gates its publishes set and what a publish decided (``fleet.learn.gates``). The rounds acting
on them are ``test_learn.py``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract import UploadInfo
from fleet.learn.gates import (
    device_gate_args,
    publish_verdict,
    refusal_reason,
    upstream_gate_args,
)
from fleet.learn.plan import LearnPlan
from fleet.learn.quorum import aggregate_skip_reason, has_quorum, skip_reason
from fleet.learn.store import GateLine
from fleet.learn.updates import Upload, choose_updates, refuse_upload


def plan(tmp_path: Path, **kw: Any) -> LearnPlan:
    return LearnPlan.model_validate({
        "name": "nl", "group": "sim", "model": "digits", "base": "v1", "data": "cam0",
        "rounds": 2, "registry": str(tmp_path / "reg"), "trusted_keys": str(tmp_path / "t"),
        "sign_key": str(tmp_path / "k"), **({"max_device_drop": 1} | kw)})


def test_an_upload_is_refused_unless_it_fine_tuned_the_rounds_model_and_release() -> None:
    assert refuse_upload("d1", UploadInfo(name="digits", version="v1+d1", parent="v1"),
                         "digits", "v1") is None
    other = refuse_upload("d1", UploadInfo(name="digits", version="v9+d1", parent="v0"),
                          "digits", "v1")
    assert other is not None and other.version == "v9+d1" and "parent v0" in other.reason
    bad = refuse_upload("d1", UploadInfo(name="digits", version="../x", parent="v1"),
                        "digits", "v1")
    assert bad is not None and bad.version is None and bad.reason.startswith("upload: ")


def test_a_round_chooses_each_devices_freshest_unspent_upload_within_staleness() -> None:
    found = [Upload("a-old", "a", "r1", 5.0), Upload("a-new", "a", "r2", 1.0),
             Upload("b-1", "b", "r1", 1.0), Upload("c-1", "c", "v1", 1.0),
             Upload("d-1", "d", "r2", 1.0)]
    chosen, dropped = choose_updates(found, ["v1", "r1", "r2"], {"d-1"}, max_staleness=1)
    assert [(c.device, c.version, c.staleness) for c in chosen] == [
        ("a", "a-new", 0), ("b", "b-1", 1)]
    assert {d.version: d.reason.split(",")[0] for d in dropped} == {
        "c-1": "fine-tuned from v1", "a-old": "the same device's fresher upload a-new is used"}


def test_a_round_aggregates_at_its_quorum_and_is_skipped_short_of_it(tmp_path: Path) -> None:
    p = plan(tmp_path, min_updates=2, collect_s=60)
    assert has_quorum(p, ["a", "b"]) and not has_quorum(p, ["a"])
    assert skip_reason(p, ["a"], rollout_ended=False, now=10.0, collect_until=60.0) is None
    assert skip_reason(p, ["a"], rollout_ended=False, now=60.0, collect_until=60.0) == (
        "1 device upload(s) of the 2 needed within collect_s (60 s)")
    assert skip_reason(p, [], rollout_ended=True, now=10.0, collect_until=60.0) == (
        "0 device upload(s) of the 2 needed when its fine-tune rollout ended")
    assert aggregate_skip_reason(1, "2 usable") == "hpc-train aggregate: 2 usable"
    assert aggregate_skip_reason(0, "") is None and aggregate_skip_reason(2, "") is None


def test_the_gates_each_publish_sets(tmp_path: Path) -> None:
    assert upstream_gate_args(plan(tmp_path), None) == []
    up = plan(tmp_path, max_upstream_drop=1.5, base_checkpoint=str(tmp_path / "ck"), rounds=1)
    assert upstream_gate_args(up, tmp_path / "ck") == [
        "--max-upstream-drop", "1.5", "--base-checkpoint", str(tmp_path / "ck")]
    assert device_gate_args(plan(tmp_path)) == ["--min-devices", "1", "--max-device-drop", "1"]
    both = plan(tmp_path, min_devices=3, min_mean_gain=0.5, gain_mean="samples")
    assert device_gate_args(both) == ["--min-devices", "3", "--min-mean-gain", "0.5",
                                      "--gain-mean", "samples", "--max-device-drop", "1"]


def test_what_a_publish_decided() -> None:
    exists = "digits@nl-r1 already exists in the registry"
    assert publish_verdict(0, "", "digits", "nl-r1", 1) == "published"
    assert publish_verdict(2, exists, "digits", "nl-r1", 2) == "published"  # a restart's
    assert publish_verdict(2, exists, "digits", "nl-r1", 1) == "taken"  # someone else's
    assert publish_verdict(2, "bad option", "digits", "nl-r1", 2) == "failed"
    assert publish_verdict(4, "", "digits", "nl-r1", 1) == "refused"
    assert publish_verdict(1, "", "digits", "nl-r1", 1) == "failed"
    gates = [GateLine(flag="--min-devices 2", passed=True, detail="2 devices"),
             GateLine(flag="--max-device-drop 1", passed=False, detail="d3 dropped 2 pts")]
    assert refusal_reason("device gates", gates) == (
        "device gates: --max-device-drop 1: d3 dropped 2 pts")


def test_a_round_keeps_the_near_identical_updates_the_aggregation_flagged(
        tmp_path: Path) -> None:
    import json

    from fleet.learn.report import round_summary
    from fleet.learn.store import RoundState
    from fleet.learn.upstream import read_aggregate

    out = tmp_path / "aggregate"
    out.mkdir()
    report = {"combined": ["v1+d1", "v1+d2", "v1+d3"], "skipped": [], "duplicates": {
        "rule": "...", "groups": [{"versions": ["v1+d2", "v1+d3"], "keys": ["d2", "d3"]}]}}
    (out / "aggregate.json").write_text(json.dumps(report))
    res = read_aggregate(out, {"v1+d1": "d1", "v1+d2": "d2", "v1+d3": "d3"})
    assert res is not None and res.duplicates == [["v1+d2", "v1+d3"]]
    rs = RoundState(round=1, base="v1", started_at=0.0, duplicates=res.duplicates)
    assert round_summary(rs)["duplicates"] == [["v1+d2", "v1+d3"]]
    del report["duplicates"]  # a report from before the flag: none
    (out / "aggregate.json").write_text(json.dumps(report))
    res = read_aggregate(out, {})
    assert res is not None and res.duplicates == []
