"""The rollout report shows what each device's export chose, and never hides a fallback."""

from __future__ import annotations

from typing import Any

from fleet.rollout.report import export_summary, table


def _report(executions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"rollout": "r1", "state": "succeeded", "reason": None,
            "plan": {"abort_metric": "eval/acc"}, "waves": [], "rolled_back": 0,
            "rollback_failed": 0, "executions": executions}


def test_a_device_whose_plain_int8_missed_its_gates_is_named_in_the_table() -> None:
    fell_back = {"winner": "int8-exclude-1", "int8_recipe": "u8s8-reduce-range",
                 "fallback": "int8 missed its gates at top-1 drop 19.80 pts (...); "
                             "int8-exclude-1 won with conv1 in float"}
    plain = {"winner": "int8", "int8_recipe": "s8s8-symmetric", "fallback": None}
    text = table(_report([{"device": "edge-1", "export": fell_back},
                          {"device": "edge-2", "export": plain},
                          {"device": "edge-3", "export": None}]))
    assert "edge-1: export fallback: int8 missed its gates at top-1 drop 19.80 pts" in text
    assert "edge-2" not in text and "edge-3" not in text


def test_export_figures_come_from_the_device_result_only_when_well_formed() -> None:
    assert export_summary({"export": {"winner": "int8"}}) == {"winner": "int8"}
    assert export_summary({"export": "int8"}) is None and export_summary(None) is None
