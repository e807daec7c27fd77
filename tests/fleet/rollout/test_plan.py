"""The rollout plan model: wave arithmetic and refusals that name the field."""

from __future__ import annotations

import re

import pytest
from pydantic import BaseModel

from fleet.cli import main
from fleet.learn.plan import LearnPlan
from fleet.rollout.plan import PlanError, RolloutPlan, validate_plan
from registry.validation import field_docs


def plan(**kw: object) -> RolloutPlan:
    return validate_plan({"name": "r", "group": "g", "job": "deploy", **kw})


def test_waves_are_cumulative_and_skip_empty_ones() -> None:
    p = plan(waves="1,5%,25%,100%")
    assert p.waves == [1, "5%", "25%", "100%"]
    assert p.wave_sizes(100) == [1, 5, 25, 100]
    assert p.wave_sizes(10) == [1, 3, 10]  # 5% of 10 rounds up to 1: that wave adds nobody
    assert p.wave_sizes(1) == [1]
    assert plan(waves=["50%"]).wave_sizes(9) == [5]  # a plan that stops at half stops there


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"waves": "0,100%"}, "waves"),
        ({"waves": "1,abc%"}, "waves"),
        ({"abort_failure_rate": 1.5}, "abort_failure_rate"),
        ({"bake": 3}, "bake"),
        ({"job": "train"}, "job"),
        ({"name": "a/b"}, "name"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_fields_are_named(fields: dict[str, object], named: str) -> None:
    with pytest.raises(PlanError) as e:
        plan(**fields)
    assert f"\n  {named}:" in str(e.value)


def test_group_xor_devices() -> None:
    with pytest.raises(PlanError, match="exactly one of group or devices"):
        validate_plan({"name": "r", "job": "deploy"})
    with pytest.raises(PlanError, match="listed twice"):
        validate_plan({"name": "r", "job": "deploy", "devices": ["a", "a"]})


def test_example_plan_loads() -> None:
    from pathlib import Path

    from fleet.rollout.plan import load_plan

    repo = Path(__file__).resolve().parents[3]
    p = load_plan(repo / "scripts/fleet/nightly_finetune.yaml", {"name": "nightly-20261123"})
    assert p.job == "finetune" and p.wave_sizes(40) == [1, 4, 40]


def test_execution_ids_fit_the_contract_for_the_longest_names() -> None:
    """The longest rollout name (40) and device id (64) still make command ids the device
    takes (at most 128 characters), distinct per rollout, device, attempt and kind."""
    from contract import check_command_id
    from fleet.rollout.run import exec_id
    from fleet.rollout.store import Rollout

    def rollout(name: str, nonce: str) -> Rollout:
        return Rollout(name, nonce, plan(name=name), "running", None, None, 0.0, 0.0, None)

    assert exec_id(rollout("canary", "a1b2c3"), "dev-1", 1) == "canary-a1b2c3.dev-1.1"
    ids = {exec_id(rollout("r" * 40, n), "d" * 63 + s, a, kind)
           for n in ("a1b2c3d4", "e5f6a7b8") for s in ("d", "x") for a in (1, 99)
           for kind in ("job", "rollback")}
    assert len(ids) == 16
    for i in ids:
        assert check_command_id(i) == i


@pytest.mark.parametrize(("command", "model"), [
    (["rollout", "create"], RolloutPlan),
    (["learn", "start"], LearnPlan),
])
def test_every_plan_flag_help_says_the_whole_description(
        command: list[str], model: type[BaseModel], capsys: pytest.CaptureFixture[str]) -> None:
    """A flag's help is its plan field's description, whole (not its first line cut
    mid-sentence): the flag and the plan file document one field once."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    def flat(s: str) -> str:  # argparse wraps lines, also after a hyphen
        return re.sub(r"-\s+", "-", " ".join(s.split()))

    text = flat(capsys.readouterr().out)
    for name, doc in field_docs(model).items():
        if name == "name":
            continue
        assert doc, f"{model.__name__}.{name} has no string under it"
        assert flat(doc) in text, name
