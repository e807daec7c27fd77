"""Per-job report: one JSON (everything, machine-readable) and one PNG (loss and accuracy,
temperature, power, duty cycle and governor state over time).

Built from what ``GovernorHook`` recorded; written atomically (temp file + fsync + rename) so
a crash never leaves half a report next to a finished job.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.pacing.hook import GovernorHook
from registry.atomic import write_json_atomic

REPORT_FORMAT = "edgetrain.job_report/1"
STATE_LEVEL = {"NORMAL": 0, "THROTTLED": 1, "PAUSED": 2}


@dataclass
class Limits:
    target_c: float
    soft_pause_c: float | None = None
    board_throttle_c: float | None = None
    critical_c: float | None = None
    power_cap_w: float | None = None


@dataclass
class JobReport:
    job: dict[str, Any]
    limits: Limits
    samples: list[dict[str, Any]]
    """Governor samples: t_s, step, temp_c, zone, power_mw (average since the last sample),
    power_now_mw (last reading), duty, state, limit, power_mode."""
    metrics: list[dict[str, Any]]
    """Training metrics: t_s, step, train/loss, the evaluation's (eval/acc, eval/map, ...)."""
    events: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "job": self.job,
            "limits": vars(self.limits),
            "summary": self.summary,
            "events": self.events,
            "samples": self.samples,
            "metrics": self.metrics,
        }


def _time_above(samples: Sequence[dict[str, Any]], target_c: float) -> float:
    total = 0.0
    for a, b in itertools.pairwise(samples):
        if a.get("temp_c") is not None and a["temp_c"] > target_c:
            total += b["t_s"] - a["t_s"]
    return total


def summarize(
    samples: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]], limits: Limits
) -> dict[str, Any]:
    temps = [s["temp_c"] for s in samples if s.get("temp_c") is not None]
    powers = [s["power_mw"] for s in samples if s.get("power_mw") is not None]
    summary: dict[str, Any] = {
        "max_temp_c": max(temps) if temps else None,
        "time_above_target_s": _time_above(samples, limits.target_c),
        "max_avg_power_w": max(powers) / 1000 if powers else None,
    }
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    accs = [m["eval/acc"] for m in metrics if "eval/acc" in m]
    if losses:
        summary["final_train_loss"] = losses[-1]
    if accs:
        summary["final_eval_acc"] = accs[-1]
    return summary


def build_report(
    hook: GovernorHook,
    limits: Limits,
    *,
    job: dict[str, Any] | None = None,
    extra_summary: dict[str, Any] | None = None,
) -> JobReport:
    rec = hook.record
    summary = summarize(rec.samples, rec.metrics, limits)
    elapsed = hook.clock.now() - hook.start_s
    summary.update(
        {
            "steps": rec.steps,
            "elapsed_s": elapsed,
            "compute_s": rec.compute_s,
            "paced_s": rec.paced_s,
            "waited_s": rec.waited_s,
            # Training time given to the application (its p99 over the SLO set the duty): the
            # fine-tune's cost of yielding, against compute_s.
            "yielded_s": rec.yielded_s,
            # Training that ran on fewer threads, the application's cores handed back.
            "fewer_threads_s": rec.fewer_threads_s,
            "worst_app_p99_ms": rec.worst_p99_ms,
            "mean_duty": rec.compute_s / elapsed if elapsed > 0 else None,
            "events": len(hook.controller.events),
        }
    )
    summary.update(extra_summary or {})
    return JobReport(
        job=dict(job or {}),
        limits=limits,
        samples=list(rec.samples),
        metrics=list(rec.metrics),
        events=[e.to_dict() for e in hook.controller.events],
        summary=summary,
    )


def plot_report(report: JobReport, path: Path) -> Path:
    """Five stacked panels sharing the time axis (minutes)."""
    from hpc_core.plots import figure, write_png

    fig = figure(figsize=(10, 11), layout="constrained")
    axes = fig.subplots(5, 1, sharex=True)
    s = report.samples
    t = [x["t_s"] / 60 for x in s]
    lim = report.limits

    ax = axes[0]
    mt = [m["t_s"] / 60 for m in report.metrics if "train/loss" in m]
    ax.plot(
        mt,
        [m["train/loss"] for m in report.metrics if "train/loss" in m],
        color="tab:blue",
        lw=1,
        label="train loss",
    )
    ax.set_ylabel("loss")
    # The task's gate metric: eval/acc of a classifier, eval/map of a detector.
    gate = str(report.job.get("gate_metric") or "eval/acc")
    acc = [(m["t_s"] / 60, m[gate]) for m in report.metrics if gate in m]
    if acc:
        ax2 = ax.twinx()
        ax2.plot(
            [a for a, _ in acc], [b for _, b in acc], "o-", color="tab:green",
            label=gate.replace("/", " "),
        )
        ax2.set_ylabel("accuracy" if gate == "eval/acc" else gate)
        ax2.set_ylim(0, 1)
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title(f"{report.job.get('name', 'job')} on {report.job.get('profile', '?')}")

    ax = axes[1]
    ax.plot(t, [x["temp_c"] for x in s], color="tab:red", lw=1, label="hottest zone")
    for value, label, style in (
        (lim.target_c, "target", "--"),
        (lim.soft_pause_c, "soft pause", ":"),
        (lim.board_throttle_c, "board throttle", "-."),
    ):
        if value is not None:
            ax.axhline(value, ls=style, color="gray", lw=1, label=f"{label} {value:g} C")
    ax.set_ylabel("C")
    ax.legend(loc="lower right", fontsize=8)

    ax = axes[2]
    ax.plot(
        t,
        [(x["power_now_mw"] or 0) / 1000 for x in s],
        color="tab:orange",
        lw=0.6,
        alpha=0.35,
        label="after a step",
    )
    ax.plot(
        t, [(x["power_mw"] or 0) / 1000 for x in s], color="tab:orange", lw=1.2, label="average"
    )
    if lim.power_cap_w is not None:
        ax.axhline(lim.power_cap_w, ls="--", color="gray", lw=1, label=f"cap {lim.power_cap_w:g} W")
    ax.set_ylabel("W")
    ax.legend(loc="lower right", fontsize=8)

    ax = axes[3]
    ax.step(t, [x["duty"] for x in s], where="post", color="tab:purple", lw=1)
    ax.set_ylabel("duty")
    ax.set_ylim(-0.05, 1.05)

    ax = axes[4]
    ax.step(t, [STATE_LEVEL.get(x["state"], 0) for x in s], where="post", color="black", lw=1)
    ax.set_yticks(list(STATE_LEVEL.values()), list(STATE_LEVEL))
    ax.set_xlabel("time (min)")
    for ev in report.events:
        if ev["kind"] == "power_mode" and ev["old"] != ev["new"]:
            for a in axes:
                a.axvline(ev["t_s"] / 60, color="tab:cyan", lw=0.8)
            axes[2].annotate(
                f" {ev['old']} -> {ev['new']}",
                (ev["t_s"] / 60, 0.9),
                xycoords=("data", "axes fraction"),
                fontsize=8,
                color="tab:cyan",
            )
    return write_png(fig, path, dpi=110)


def write_report(report: JobReport, out_dir: Path, stem: str = "report") -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.png`` into ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    write_json_atomic(json_path, report.to_dict())
    png_path = plot_report(report, out_dir / f"{stem}.png")
    return json_path, png_path
