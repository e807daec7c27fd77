"""A rollout's final report: JSON (the record), a table (for the terminal) and a PNG of
executions over time per wave. Built from the store alone, so it can be made again at any
time with ``fleetctl rollout report ID``."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.inventory import render_table
from fleet.rollout.progress import failures_text, headline
from fleet.rollout.run import RolloutRun, summarize
from fleet.rollout.store import Execution, FleetStore
from registry.atomic import write_bytes_atomic


@dataclass
class RunCache:
    """What a reader that reads a rollout again and again (the dashboard) keeps of it between
    reads: each execution's raw row and what was built from it, and the targets."""

    rows: dict[str, tuple[tuple[Any, ...], Execution]] = field(default_factory=dict)
    targets: list[tuple[str, int]] = field(default_factory=list)
    targets_key: tuple[int, ...] | None = None
    """The waves' cumulative targets the targets were read at (a device joining a dynamic
    rollout moves them)."""


def load_run(store: FleetStore, rid: str, cache: RunCache | None = None) -> RolloutRun:
    """Rollout ``rid`` from the store. With ``cache`` (kept current here), only the executions
    whose row changed since the last read are built again, and the targets are read again only
    when the waves' sizes moved: a 10,000-device rollout read every half second by the
    dashboard."""
    r = store.rollout(rid)
    if r is None:
        raise KeyError(f"no rollout {rid!r}; `fleetctl rollout list` shows them")
    waves = store.waves(rid)
    if cache is None:
        run = RolloutRun(r, waves, store.targets(rid))
        run.execs = {e.id: e for e in store.executions(rid)}
        return run
    key = tuple(w.target for w in waves)
    if key != cache.targets_key:
        cache.targets, cache.targets_key = store.targets(rid), key
    run = RolloutRun(r, waves, list(cache.targets))
    fresh: dict[str, tuple[tuple[Any, ...], Execution]] = {}
    for row in store.execution_rows(rid):
        old = cache.rows.get(row[0])
        fresh[row[0]] = old if old is not None and old[0] == row else (row,
                                                                        Execution.from_row(row))
    cache.rows = fresh
    run.execs = {k: e for k, (_, e) in fresh.items()}
    return run


def build(run: RolloutRun) -> dict[str, Any]:
    s = summarize(run)
    latest = run.latest()
    m = run.plan.abort_metric
    for w in s["waves"]:
        drops = [e.metric_before - e.metric_after for e in latest.values()
                 if e.wave == w["wave"] and e.metric_before is not None
                 and e.metric_after is not None]
        w[f"median_drop_{m}"] = round(statistics.median(drops), 6) if drops else None
    execs = sorted(run.execs.values(), key=lambda e: (e.created_at, e.id))
    return {
        "rollout": s["id"],
        "key": f"{run.rollout.id}-{run.rollout.nonce}",
        "state": s["state"],
        "reason": s["reason"],
        "plan": run.plan.model_dump(mode="json"),
        "created_at": run.rollout.created_at,
        "finished_at": run.rollout.finished_at,
        "targets": s["targets"],
        "waves": s["waves"],
        "rolled_back": s["rolled_back"],
        "rollback_failed": s["rollback_failed"],
        "failures": s["failures"],
        "executions": [{
            "id": e.id, "device": e.device, "wave": e.wave, "kind": e.kind,
            "attempt": e.attempt, "status": e.status, "outcome": e.outcome,
            "sent_at": e.sent_at, "started_at": e.started_at, "finished_at": e.finished_at,
            "metric_before": e.metric_before, "metric_after": e.metric_after,
            "error_code": e.error_code, "error_message": e.error_message,
            "defers": e.defers, "export": export_summary(e.result),
        } for e in execs],
    }


def export_summary(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a device's export chose (winner, INT8 recipe, ISA) and, when plain INT8 missed
    its gates, what it measured and what was left in float: a fallback is never hidden."""
    export = (result or {}).get("export")
    return export if isinstance(export, dict) else None


WAVE_COLUMNS = ["wave", "state", "devices", "sent", "running", "succeeded", "failed", "canceled"]


def table(report: dict[str, Any]) -> str:
    """The headline, the per-wave table, then each failed device with its reason and each
    export fallback."""
    head = headline(report["rollout"], report)
    failed = failures_text(report.get("failures") or [], "the JSON report lists them all")
    cols = [*WAVE_COLUMNS, f"median_drop_{report['plan']['abort_metric']}"]
    tail = f"rolled back: {report['rolled_back']}, rollback failed: {report['rollback_failed']}"
    fallbacks = [f"{e['device']}: export fallback: {e['export']['fallback']}"
                 for e in report["executions"] if (e.get("export") or {}).get("fallback")]
    return "\n".join([head, render_table(report["waves"], cols), tail,
                      *([failed] if failed else []), *fallbacks])


def plot_png(report: dict[str, Any]) -> bytes:
    """Finished executions over time, one cumulative line per wave from its start; failures
    marked x, bake periods shaded, rollbacks dashed, the rollout's end a grey line."""
    from hpc_core.plots import figure, png_bytes

    t0 = report["created_at"]
    fig = figure(figsize=(8, 4.5), layout="tight")
    ax = fig.subplots()
    jobs = [e for e in report["executions"] if e["kind"] == "job" and e["finished_at"]]
    for w in report["waves"]:
        mine = sorted((e for e in jobs if e["wave"] == w["wave"]), key=lambda e: e["finished_at"])
        if not mine or w["started_at"] is None:
            continue
        # Each wave's line starts at 0 when the wave starts, so its delay and speed both show.
        ts = [w["started_at"] - t0] + [e["finished_at"] - t0 for e in mine]
        (line,) = ax.step(ts, range(len(ts)), where="post", marker=".", markersize=3,
                          label=f"wave {w['wave']} ({w['devices']} devices)")
        bad = [(e["finished_at"] - t0, i + 1) for i, e in enumerate(mine)
               if e["status"] != "SUCCEEDED" or e["outcome"] == "rolled_back"]
        if bad:
            ax.plot(*zip(*bad, strict=True), "x", color=line.get_color(), markersize=7)
        if w["finished_at"] and w["state"] == "done":
            ax.axvspan(ts[-1], w["finished_at"] - t0, color=line.get_color(), alpha=0.08)
    rbs = sorted(e["finished_at"] - t0 for e in report["executions"]
                 if e["kind"] == "rollback" and e["finished_at"])
    if rbs:
        ax.step(rbs, range(1, len(rbs) + 1), where="post", linestyle="--", label="rollbacks")
    if report["finished_at"]:
        ax.axvline(report["finished_at"] - t0, color="grey", linewidth=0.8)
    ax.set_xlabel("seconds since the rollout was created")
    ax.set_ylabel("executions finished")
    ax.set_title(headline(report["rollout"], report).removeprefix("rollout "))
    ax.legend(loc="upper left")
    return png_bytes(fig)


def write(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rid = report["rollout"]
    paths = {"json": out_dir / f"{rid}.json", "table": out_dir / f"{rid}.txt",
             "png": out_dir / f"{rid}.png"}
    write_bytes_atomic(paths["json"], json.dumps(report, indent=1).encode())
    write_bytes_atomic(paths["table"], (table(report) + "\n").encode())
    write_bytes_atomic(paths["png"], plot_png(report))
    return paths
