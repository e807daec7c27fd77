"""The Grafana dashboard the repository ships (configs/grafana/), read the way Grafana reads
it: the metric names its PromQL queries name, for the tests that scrape the endpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "edgetrain-fleet.json"

_NAME = re.compile(r"\b(edge_agent_[a-z_]+|nv_inference_[a-z_]+|edgetrain_[a-z_]+)\b")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queried_metrics(prefix: str) -> set[str]:
    """Every metric name starting ``prefix`` in the dashboard's panel queries and variables."""
    d = dashboard()
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in d["templating"]["list"] if "definition" in v]
    return {m for e in exprs for m in _NAME.findall(e) if m.startswith(prefix)}
