"""What an ``hpc-train tune`` study leaves behind: the trial table (``summary.md``, also
printed by every worker), ``best_config.yaml`` (the best trial's resolved config, ready for
``hpc-train train``) and ``history.png``; written by the last worker once no trial runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from registry.atomic import write_bytes_atomic

# Not imported: optuna until a report is written.


def counted(study: Any) -> list[Any]:
    """The study's trials, less the surplus asks that lost a race for the last slot."""
    return [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]


def summary_markdown(study: Any, metric: str) -> str:
    trials = counted(study)
    states = [t.state.name.lower() for t in trials]
    tally = ", ".join(f"{states.count(s)} {s}" for s in ("complete", "pruned", "fail", "running"))
    lines = [
        f"{tally} (study {study.study_name!r})",
        "",
        f"| trial | state | {metric} | steps | seconds | worker | params | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in trials:
        value = t.value
        if value is None and t.intermediate_values:
            value = t.intermediate_values[max(t.intermediate_values)]
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t.params.items())
        lines.append(
            f"| {t.number} | {t.state.name.lower()} | "
            f"{'' if value is None else f'{value:.4f}'} | {t.user_attrs.get('steps', '')} | "
            f"{t.user_attrs.get('seconds', '')} | {t.user_attrs.get('worker', '')} | {params} | "
            f"{_error(t)} |"
        )
    return "\n".join(lines) + "\n"


def _error(t: Any) -> str:
    """A failed trial's error, first line, fit for a table cell."""
    from optuna.trial import TrialState

    if t.state != TrialState.FAIL:
        return ""
    # A trial failed by another worker's stale-heartbeat check carries no error of its own.
    text = t.user_attrs.get("error") or "no heartbeat: its worker died"
    first = text.splitlines()[0]
    if len(first) > 160:
        first = first[:157] + "..."
    return first.replace("|", "\\|")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_reports(study: Any, metric: str, out: Path) -> Path | None:
    """best_config.yaml, summary.md and history.png; returns the best config's path."""
    from optuna.trial import TrialState

    write_bytes_atomic(out / "summary.md", summary_markdown(study, metric).encode())
    plot_history(study, metric, out / "history.png")
    complete = [t for t in counted(study) if t.state == TrialState.COMPLETE]
    if not complete:
        return None
    pick = max if study.direction.name == "MAXIMIZE" else min
    best = pick(complete, key=lambda t: t.value)
    cfg = dict(best.user_attrs["config"])
    cfg["run"] = {
        **cfg["run"],
        "output_dir": str(out / "best"),
        "name": f"{cfg['run']['name']}-best",
    }
    header = (
        f"# best trial {best.number} of study {study.study_name!r}: {metric}={best.value:.4f}\n"
    )
    path = out / "best_config.yaml"
    write_bytes_atomic(path, (header + yaml.safe_dump(cfg, sort_keys=False)).encode())
    return path


def plot_history(study: Any, metric: str, path: Path) -> None:
    from optuna.trial import TrialState

    from hpc_core.plots import figure, write_png

    fig = figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    done = [t for t in counted(study) if t.state == TrialState.COMPLETE]
    pruned = [t for t in counted(study) if t.state == TrialState.PRUNED]
    failed = [t.number for t in counted(study) if t.state == TrialState.FAIL]
    ax.scatter([t.number for t in done], [t.value for t in done], label="complete", zorder=3)
    pv = [
        (t.number, t.intermediate_values[max(t.intermediate_values)])
        for t in pruned
        if t.intermediate_values
    ]
    if pv:
        ax.scatter(*zip(*pv, strict=True), marker="x", color="grey", label="pruned (last report)")
    for i, n in enumerate(failed):
        ax.axvline(n, color="C3", alpha=0.3, label="failed" if i == 0 else None)
    if done:
        pick = max if study.direction.name == "MAXIMIZE" else min
        best, xs, ys = None, [], []
        for t in sorted(done, key=lambda t: t.number):
            best = t.value if best is None else pick(best, t.value)
            xs.append(t.number)
            ys.append(best)
        ax.step(xs, ys, where="post", color="C1", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(f"study {study.study_name}")
    ax.legend()
    write_png(fig, path)
