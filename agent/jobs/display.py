"""The device job's progress display and final summary (``agentctl finetune``, ``agentctl job``).

One display across the stages, fed by :attr:`JobContext.on_event` (stage starts and ends,
planning, heartbeats of long child steps) and by the job's progress row in the store (the
fine-tune child writes the optimizer step, loss, micro-batch and governor state there). At a
terminal it is one live line; elsewhere (journald, CI) each event is one JSON line (``json``)
or one plain line, the fine-tune's step at most every ``every_s`` seconds.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import IO, Any, Literal

from agent.jobs.store import JobStore

Mode = Literal["live", "json", "plain"]
BAR = 24


def bar(done: int, total: int) -> str:
    filled = BAR * done // max(total, 1)
    return "#" * filled + "-" * (BAR - filled)


class ProgressDisplay:
    def __init__(self, store: JobStore, job_id: str, mode: Mode | None = None,
                 out: IO[str] | None = None, every_s: float = 2.0) -> None:
        self.store, self.job_id, self.out = store, job_id, out or sys.stderr
        self.mode: Mode = mode or ("live" if self.out.isatty() else "json")
        self.every_s = every_s
        self.stage = "start"
        self.plan: dict[str, Any] | None = None
        self._last_progress: dict[str, Any] | None = None
        self._last_print = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="job-progress", daemon=True)

    def __enter__(self) -> ProgressDisplay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.mode == "live":
            self.out.write("\n")
            self.out.flush()

    # -- feeds ---------------------------------------------------------------------------

    def on_event(self, stage: str, detail: dict[str, Any]) -> None:
        with self._lock:
            self.stage = stage
            if detail.get("plan"):
                self.plan = detail["plan"]
            status = detail.get("status", "")
            if self.mode == "live":
                self._live(f"{stage}: {status}" + _brief(detail))
                if status == "done":
                    self.out.write("\n")
                return
            event = {"job": self.job_id, "stage": stage, **_jsonable(detail)}
            self._emit(event, f"{stage}: {status}{_brief(detail)}")

    def _poll(self) -> None:
        store = JobStore(self.store.state_dir)  # this thread's own connection
        while not self._stop.wait(0.25):
            rec = store.get(self.job_id)
            p = rec.progress if rec is not None else None
            if not p or p == self._last_progress or p.get("stage") != self.stage:
                continue
            if p.get("step") is None:  # a stage's own event: on_event has shown it
                continue
            now = time.monotonic()
            if self.mode != "live" and now - self._last_print < self.every_s:
                continue
            self._last_progress, self._last_print = p, now
            with self._lock:
                self._show_progress(p)
        store.close()

    def _show_progress(self, p: dict[str, Any]) -> None:
        d = p.get("detail") or {}
        step, total = int(p.get("step", 0)), int(p.get("total", 0))
        parts = [f"{p['stage']} [{bar(step, total)}] {step}/{total}"]
        if d.get("loss") is not None:
            parts.append(f"loss {d['loss']:.3f}")
        if d.get("micro_batch"):
            parts.append(f"micro-batch {d['micro_batch']}")
        if d.get("governor"):
            temp = f" {d['temp_c']:.1f} C" if d.get("temp_c") is not None else ""
            parts.append(f"governor {d['governor']} duty {d.get('duty', 1):.2f}{temp}")
        if self.plan:
            parts.append(f"plan {self.plan['micro_batch_size']}x{self.plan['accumulation_steps']}"
                         f" ~{self.plan['predicted_tree_peak_mb']:.0f}/"
                         f"{self.plan['budget_mb']:.0f} MB")
        line = " | ".join(parts)
        if self.mode == "live":
            self._live(line)
        else:
            self._emit({"job": self.job_id, "stage": p["stage"], "status": "progress",
                        "step": step, "total": total, **_jsonable(d)}, line)

    # -- output --------------------------------------------------------------------------

    def _live(self, line: str) -> None:
        width = 118
        self.out.write("\r" + line[:width].ljust(width))
        self.out.flush()

    def _emit(self, event: dict[str, Any], plain: str) -> None:
        text = json.dumps(event, sort_keys=True) if self.mode == "json" else plain
        self.out.write(text + "\n")
        self.out.flush()


def _brief(d: dict[str, Any]) -> str:
    if d.get("status") == "planning":
        return f" memory plan for {d.get('budget_mb', 0):.0f} MB (probes)"
    if d.get("plan"):
        p = d["plan"]
        return (f" micro-batch {p['micro_batch_size']} x {p['accumulation_steps']}, predicted "
                f"tree peak {p['predicted_tree_peak_mb']:.0f} MB of {p['budget_mb']:.0f}")
    if d.get("status") == "running":
        return f" {d.get('elapsed_s', 0)} s ... {d.get('last', '')}"
    return ""


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def summary_rows(rec: Any, steps: list[Any]) -> list[tuple[str, str]]:
    """The job's figures, one (label, value) row each, from its stored result and steps."""
    r = rec.result or {}
    out = {s.name: s.outputs or {} for s in steps if s.status == "done"}
    health, ft, ex = out.get("health", {}), out.get("finetune", {}), out.get("export", {})
    rows = [("job", f"{rec.id} ({rec.type}) {rec.state.value}, attempt {rec.attempt}")]
    if health.get("active") and health.get("staged"):
        # The task's gate metric (top-1 accuracy of a classifier, mAP of a detector).
        a, st = health["active"], health["staged"]
        label = ("accuracy" if st.get("accuracy") is not None
                 else f"eval/{health.get('gate_metric', 'acc')}")
        rows.append((f"{label} (held-out device data)",
                     f"{_pct(a.get('metric', a.get('accuracy')))} -> "
                     f"{_pct(st.get('metric', st.get('accuracy')))} ({health['samples']} "
                     f"samples, {st['runtime']})"))
    if ex:
        drop = ex.get("int8_drop_pts")
        p50 = ex.get("p50_ms_b1")
        rows.append(("export", f"{ex.get('winner')} won"
                     + (f", {_drop_label(ex)} drop {drop:.2f} pts" if drop is not None else "")
                     + (f", p50 {p50:.3f} ms at batch 1" if p50 is not None else "")
                     + (f", recipe {ex['int8_recipe']}" if ex.get("int8_recipe") else "")
                     + f" ({ex.get('seconds', 0):.1f} s)"))
        if ex.get("fallback"):
            rows.append(("export fallback", ex["fallback"]))
    mem = r.get("memory") or {}
    if mem.get("peak_tree_mb") is not None and mem.get("budget_mb") is not None:
        plan = (ft.get("memory") or {}).get("plan") or {}
        rows.append(("peak memory vs budget (whole job, PSS)",
                     f"{mem['peak_tree_mb']:.0f} MB / {mem['budget_mb']:.0f} MB in "
                     f"{mem.get('peak_step')}"
                     + (f" (micro-batch {plan['micro_batch_size']} x "
                        f"{plan['accumulation_steps']})" if plan else "")))
    if ft:
        t, target = ft.get("max_temp_c"), ft.get("target_c")
        rows.append(("max temperature vs target",
                     "n/a (no sensors)" if t is None else f"{t:.1f} C / {target:.1f} C"))
        rows.append(("fine-tune", f"{ft.get('steps')} steps, {ft.get('stopped_reason')}"))
    kind = r.get("outcome")
    if kind == "committed":
        rows.append(("result", f"committed {r['model']['version']} (slot {r['model']['slot']})"))
    elif kind == "rolled_back":
        rows.append(("result", f"rolled back: {r.get('reason')}"))
    elif rec.error:
        rows.append(("result", f"{rec.error['code']}: {rec.error['message']}"))
    up = r.get("uploaded")
    rows.append(("uploaded", f"{up['name']}@{up['version']} (parent {up['parent']})"
                 if up else "no"))
    times = [f"{s.name} {s.finished_at - s.started_at:.1f}s" for s in steps
             if s.started_at and s.finished_at]
    if times:
        rows.append(("stage times", ", ".join(times)))
    return rows


def print_rows(rows: list[tuple[str, str]], out: IO[str] | None = None) -> None:
    out = out or sys.stderr
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")


def _drop_label(ex: dict[str, Any]) -> str:
    """What the export's drop is of: top-1, or a detector's gate metric (map)."""
    metric = ex.get("gate_metric") or "acc"
    return "top-1" if metric == "acc" else metric
