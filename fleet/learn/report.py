"""A learn as people read it: ``fleetctl learn status`` (JSON or a table: per round the
updates used, skipped and dropped, the devices' evaluation and the gate figures, the release)
and the report, JSON plus a PNG of accuracy per round (the base and the candidate on the
devices' own data, and each device's spread). Built from the store alone, so it can be made at
any time, while a learn runs or after.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from fleet.inventory import render_table
from fleet.learn.store import Learn, LearnStore, RoundState
from fleet.learn.updates import History, collect_updates
from fleet.rollout import report as rollout_reports
from fleet.rollout.run import RolloutRun, summarize
from fleet.rollout.store import FleetStore
from registry.atomic import write_bytes_atomic


def _evals(rs: RoundState) -> dict[str, Any]:
    ev = rs.evaluations
    out: dict[str, Any] = {"devices": len(ev), "missing": len(rs.not_evaluated)}
    if ev:
        worst = min(ev, key=lambda e: e.gain_pts)
        out |= {
            "base_accuracy": statistics.fmean(e.base_accuracy for e in ev),
            "candidate_accuracy": statistics.fmean(e.candidate_accuracy for e in ev),
            "personalized_accuracy": statistics.fmean(pers) if (pers := [
                e.personalized_accuracy for e in ev if e.personalized_accuracy is not None])
            else None,
            "mean_gain_pts": round(statistics.fmean(e.gain_pts for e in ev), 4),
            "worst_gain_pts": round(worst.gain_pts, 4), "worst_device": worst.device,
        }
    return out


def round_summary(rs: RoundState) -> dict[str, Any]:
    return {
        "round": rs.round, "base": rs.base, "phase": rs.phase, "outcome": rs.outcome,
        "reason": rs.reason,
        "updates": {"chosen": len(rs.updates), "combined": len(rs.combined),
                    "skipped": len(rs.skipped), "dropped": len(rs.dropped),
                    "stale": sum(u.staleness > 0 for u in rs.updates)},
        "chosen": [u.model_dump() for u in rs.updates], "combined": rs.combined,
        "skipped": [d.model_dump() for d in rs.skipped],
        "duplicates": rs.duplicates,
        "dropped": [d.model_dump() for d in rs.dropped],
        "candidate": rs.candidate, "evaluation": _evals(rs),
        "evaluations": [dict(e.model_dump(), gain_pts=round(e.gain_pts, 4))
                        for e in rs.evaluations],
        "not_evaluated": [d.model_dump() for d in rs.not_evaluated],
        "gates": [g.model_dump() for g in rs.gates],
        "release": rs.release, "deploy": rs.deploy_state, "rollouts": rs.rollouts,
        "tool_runs": rs.tool_runs, "started_at": rs.started_at, "finished_at": rs.finished_at,
    }


def _rollout_line(run: RolloutRun) -> dict[str, Any]:
    s = summarize(run)
    return {"id": s["id"], "state": s["state"], "devices": s["targets"],
            "succeeded": sum(w["succeeded"] for w in s["waves"]),
            "failed": sum(w["failed"] for w in s["waves"]),
            "running": sum(w["running"] for w in s["waves"])}


def build(store: FleetStore, learn: Learn, rounds: list[RoundState]) -> dict[str, Any]:
    """The learn's status: the plan's outline, every round, and where the current one is."""
    runs: dict[str, RolloutRun] = {}

    def run_of(rid: str) -> RolloutRun:
        if rid not in runs:
            runs[rid] = rollout_reports.load_run(store, rid)
        return runs[rid]

    plan = learn.plan
    out: dict[str, Any] = {
        "learn": learn.id, "state": learn.state, "reason": learn.reason, "model": plan.model,
        "group": plan.group, "targets": len(learn.targets), "rounds": plan.rounds,
        "round": learn.round, "base": learn.base, "created_at": learn.created_at,
        "finished_at": learn.finished_at, "history": [round_summary(r) for r in rounds],
        "current": None,
    }
    cur = next((r for r in rounds if r.round == learn.round), None)
    if cur is not None and cur.phase != "done":
        now: dict[str, Any] = {"round": cur.round, "phase": cur.phase,
                               "rollouts": {p: _rollout_line(run_of(rid))
                                            for p, rid in cur.rollouts.items()}}
        if cur.phase == "finetune" and "finetune" in cur.rollouts:
            chosen, _ = collect_updates(learn, cur, History(learn, rounds, cur.round), run_of)
            now |= {"uploads": len(chosen), "needed": plan.min_updates,
                    "collect_left_s": max(0.0, round((cur.collect_until or 0) - time.time(), 1))}
        out["current"] = now
    return out


def load(store: FleetStore, learns: LearnStore, lid: str) -> dict[str, Any]:
    learn = learns.learn(lid)
    if learn is None:
        raise KeyError(f"no learn {lid!r}; `fleetctl learn list` shows them")
    return build(store, learn, learns.rounds(lid))


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.1f}%"


def _pts(x: float | None) -> str | None:
    return None if x is None else f"{x:+.2f}"


def text(s: dict[str, Any]) -> str:
    head = (f"learn {s['learn']}: {s['state']}, round {s['round']} of {s['rounds']}, base "
            f"{s['base']} ({s['model']}, {s['group'] or 'device list'}, {s['targets']} devices)")
    lines = [head + (f"\n  {s['reason']}" if s["reason"] else "")]
    cur = s["current"]
    if cur is not None:
        where = f"round {cur['round']}: {cur['phase']}"
        if "uploads" in cur:
            where += (f", {cur['uploads']} of {cur['needed']} device uploads in, "
                      f"{cur['collect_left_s']:g} s left to collect")
        lines.append(where)
        lines += [f"  rollout {r['id']}: {r['state']} ({r['succeeded']} succeeded, "
                  f"{r['failed']} failed, {r['running']} running of {r['devices']})"
                  for r in cur["rollouts"].values()]
    rows = []
    for r in s["history"]:
        u, ev = r["updates"], r["evaluation"]
        rows.append({
            "round": r["round"], "base": r["base"],
            "outcome": r["outcome"] or r["phase"],
            "used": u["combined"] if r["phase"] != "finetune" else None,
            "skipped": u["skipped"], "dropped": u["dropped"], "stale": u["stale"],
            "evals": f"{ev['devices']}/{ev['devices'] + ev['missing']}"
            if ev["devices"] + ev["missing"] else None,
            "base_acc": _pct(ev.get("base_accuracy")),
            "cand_acc": _pct(ev.get("candidate_accuracy")),
            "pers_acc": _pct(ev.get("personalized_accuracy")),
            "gain": _pts(ev.get("mean_gain_pts")), "worst": _pts(ev.get("worst_gain_pts")),
            "release": r["release"], "deploy": r["deploy"],
        })
    lines.append(render_table(rows, ["round", "base", "outcome", "used", "skipped", "dropped",
                                     "stale", "evals", "base_acc", "cand_acc",
                                     *(["pers_acc"] if any(r["pers_acc"] for r in rows) else []),
                                     "gain", "worst",
                                     "release", "deploy"]))
    for r in s["history"]:
        notes = [f"  {'pass' if g['passed'] else 'FAIL'} {g['flag']}: {g['detail']}"
                 for g in r["gates"]]
        if r["reason"]:
            notes.insert(0, f"  {r['outcome'] or r['phase']}: {r['reason']}")
        notes += [f"  aggregate skipped {d['version']} ({d['device']}): {d['reason']}"
                  for d in r["skipped"]]
        notes += [f"  near-identical updates under several keys (combined, flagged): "
                  f"{', '.join(group)}" for group in r["duplicates"]]
        if notes:
            lines.append(f"round {r['round']}:\n" + "\n".join(notes))
    return "\n".join(lines)


def plot_png(s: dict[str, Any]) -> bytes:
    """Accuracy per round on the devices' held-out data: the base's and the candidate's
    means, each device's candidate score (the spread), a published round's candidate filled,
    a refused one hollow."""
    from hpc_core.plots import figure, png_bytes

    fig = figure(figsize=(7, 4.2), layout="tight")
    ax = fig.subplots()
    done = [r for r in s["history"] if r["evaluations"]]
    for r in done:
        k = r["round"]
        cands = [100 * e["candidate_accuracy"] for e in r["evaluations"]]
        ax.plot([k] * len(cands), cands, ".", color="tab:blue", alpha=0.35, markersize=5)
    if done:
        ks = [r["round"] for r in done]
        ax.plot(ks, [100 * r["evaluation"]["base_accuracy"] for r in done], "s--",
                color="grey", label="base (device mean)")
        ax.plot(ks, [100 * r["evaluation"]["candidate_accuracy"] for r in done], "-",
                color="tab:blue", label="candidate (device mean)")
        for r in done:
            ok = r["release"] is not None
            ax.plot(r["round"], 100 * r["evaluation"]["candidate_accuracy"], "o",
                    color="tab:blue", markerfacecolor="tab:blue" if ok else "white",
                    markersize=8)
        ax.plot([], [], ".", color="tab:blue", alpha=0.5, label="candidate, each device")
        ax.plot([], [], "o", color="tab:blue", markerfacecolor="white",
                label="refused by the gates")
        ax.legend(loc="best", fontsize=8)
        ax.set_xticks(ks)
    else:
        ax.text(0.5, 0.5, "no round evaluated yet", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("round")
    ax.set_ylabel("held-out accuracy on the devices (%)")
    ax.set_title(f"learn {s['learn']}: {s['state']}, base {s['base']}")
    return png_bytes(fig)


def write(s: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"learn-{s['learn']}.json",
             "png": out_dir / f"learn-{s['learn']}.png"}
    write_bytes_atomic(paths["json"], json.dumps(s, indent=1).encode())
    write_bytes_atomic(paths["png"], plot_png(s))
    return paths
