"""Dashboard benchmark: ``fleetctl dashboard`` over a large simulated fleet, in headless Chromium.

The fleet benchmark's set-up (``benchmarks/fleet_tier.py``: one mosquitto, the simulated
devices in a process of their own, ``python -m fleet.sim``), a ``fleetctl controller
--forever`` on SQLite, a warm-up rollout, then ``--pairs`` pairs of the same rollout
(``deploy``, waves 1%,10%,100%, no bake) without and with the dashboard, in ABBA order (a
drift of the host's speed over the run falls on both sides). A run with it starts a
``fleetctl dashboard``, opens a page on it in headless Chromium, waits until the page has the
whole fleet, then times the rollout; both are closed before the next run.
Printed:

- first paint: a fresh page's load to the moment the fleet is on it (the page's own
  ``dashboard-rendered`` mark: counts, the first 50 rows, the rollouts), and the browser's
  first contentful paint, target <= 2 s;
- live update lag: for each wave start and end and the rollout's end, the time the page's DOM
  showed it (a MutationObserver, ``Date.now()``) minus the time the controller recorded it
  in the db (``waves.started_at`` / ``finished_at``, ``rollouts.finished_at``): the worst,
  target <= 1 s;
- the controller's rollout time (first send to last result): the median of the runs with the
  page open over the median of the runs without, target <= 1.05x; and the CPU seconds the
  dashboard process and the browser took during a rollout (on this benchmark's 2-core host
  the simulated fleet keeps both cores busy, so every CPU second they take is the
  controller's and the simulated devices' too).

    python benchmarks/dashboard.py              # 10,000 devices
    python benchmarks/dashboard.py --quick      # 20 devices: it runs, its figures mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.agent import proc_cpu_s  # noqa: E402
from benchmarks.fleet_tier import (  # noqa: E402
    Proc,
    rollout_facts,
    start_sims,
    start_single,
    stop_sims,
)
from benchmarks.harness import cpu_line, parse_args, verdict  # noqa: E402
from fleet.db import Database  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FIRST_PAINT_S = 2.0
LAG_S = 1.0
OVERHEAD_X = 1.05
OBSERVER = """() => {
  window.__seen = {};
  const mark = () => {
    const now = Date.now();
    for (const card of document.querySelectorAll('#rollouts article.rollout')) {
      const rid = card.id.slice('rollout-'.length);
      const head = card.querySelector('h3 .state');
      if (head) window.__seen[`${rid}|rollout|${head.dataset.state}`] ??= now;
      for (const row of card.querySelectorAll('tr[data-wave]')) {
        const st = row.querySelector('.state');
        window.__seen[`${rid}|${row.dataset.wave}|${st.dataset.state}`] ??= now;
      }
    }
  };
  new MutationObserver(mark).observe(document.getElementById('rollouts'),
                                     {childList: true, subtree: true});
  mark();
}"""


def wait_final(db: str, rid: str, timeout_s: float) -> str:
    d = Database(db)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            row = d.execute("SELECT state FROM rollouts WHERE id = :r", {"r": rid}).fetchone()
            if row is not None and row[0] in ("succeeded", "completed_with_failures",
                                              "aborted", "rolled_back"):
                return str(row[0])
            time.sleep(0.1)
    finally:
        d.close()
    raise TimeoutError(f"rollout {rid} not finished after {timeout_s:.0f} s")


def rollout(base: list[str], logs: Path, db: str, name: str, version: int,
            timeout_s: float) -> dict[str, Any]:
    """One rollout created for the running controller; its facts once it is final."""
    p = Proc.spawn(f"create-{name}", [*base, "rollout", "create", "--detach", "--name", name,
                                      "--group", "sim", "--job", "deploy", "--args",
                                      json.dumps({"version": f"v{version}"}), "--waves",
                                      "1%,10%,100%", "--bake-s", "0"], logs)
    p.reap(True)
    if p.rc != 0:
        raise RuntimeError(f"rollout create exited {p.rc}: {p.tail()}")
    rid = str(p.first_json()["rollout"])
    state = wait_final(db, rid, timeout_s)
    f = rollout_facts(db, rid)
    return {"id": rid, "state": state, "rollout_s": round(f["last_result"] - f["first_sent"], 3),
            "succeeded": f["succeeded_devices"]}


def db_times(db: str, rid: str) -> dict[str, float]:
    """When the controller recorded each wave's start and end and the rollout's end."""
    d = Database(db)
    try:
        out = {}
        for idx, started, finished in d.execute(
                "SELECT idx, started_at, finished_at FROM waves WHERE rollout_id = :r",
                {"r": rid}):
            if started is not None:
                out[f"{rid}|{idx}|running"] = started
            if finished is not None:
                out[f"{rid}|{idx}|done"] = finished
        state, fin = d.execute("SELECT state, finished_at FROM rollouts WHERE id = :r",
                               {"r": rid}).one()
        out[f"{rid}|rollout|{state}"] = fin
        return out
    finally:
        d.close()


def chromium_cpu_s() -> float:
    """CPU seconds of every Chromium process of this user (the headless browser's tree)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv0 = (d / "cmdline").read_bytes().split(b"\0", 1)[0]
            if not argv0.endswith(b"/chromium"):  # the launcher execs /usr/lib/chromium/...
                continue
            total += proc_cpu_s(int(d.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return total


def with_dashboard(base: list[str], logs: Path, db: str, name: str, version: int,
                   a: argparse.Namespace, paints: bool) -> dict[str, Any]:
    """A dashboard started, a page open on it, one rollout, both closed; the rollout's facts,
    the page's lag behind the db, the CPU the dashboard and the browser took during it."""
    from playwright.sync_api import sync_playwright

    token = logs / "operator.token"
    token.write_text(os.urandom(16).hex() + "\n")
    token.chmod(0o600)
    dash = Proc.spawn(f"dashboard-{name}", [*base, "dashboard", "--port", "0",
                                            "--operator-token-file", str(token)], logs)
    out: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 60
        while not dash.out.read_bytes().endswith(b"\n"):
            if dash.reap(False) or time.monotonic() > deadline:
                raise RuntimeError(f"fleetctl dashboard did not start: {dash.tail()}")
            time.sleep(0.05)
        url = str(dash.first_json()["dashboard"])
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                # The dashboard has every device's retained status before the timed part.
                page.goto(url)
                # A function, not an expression: the page's CSP forbids the eval() that
                # Playwright's polling wraps an expression in.
                page.wait_for_function(
                    f"() => JSON.parse(document.querySelector('[data-count=devices] b')"
                    f".textContent) >= {a.devices}", timeout=120_000, polling=200)
                if paints:
                    out["first_paint"] = first_paints(browser, url)
                page.evaluate(OBSERVER)
                time.sleep(1.0)  # the page settled: what follows is the rollout's cost
                cpu0 = (proc_cpu_s(dash.popen.pid), chromium_cpu_s())
                out |= rollout(base, logs, db, name, version, a.timeout_s)
                cpu1 = (proc_cpu_s(dash.popen.pid), chromium_cpu_s())
                page.wait_for_timeout(1500)
                seen = page.evaluate("window.__seen")
            finally:
                browser.close()
    finally:
        dash.popen.terminate()
        dash.reap(True)
    truth = db_times(db, out["id"])
    out["lag_s"] = {k: round(seen[k] / 1000 - t, 3) for k, t in truth.items() if k in seen}
    out["lag_missing"] = sorted(set(truth) - set(seen))
    out["dashboard_cpu_s"] = round(cpu1[0] - cpu0[0], 2)
    out["browser_cpu_s"] = round(cpu1[1] - cpu0[1], 2)
    return out


def first_paints(browser: Any, url: str) -> list[dict[str, Any]]:
    paints = []
    for _ in range(3):
        fresh = browser.new_page(viewport={"width": 1280, "height": 900})
        t0 = time.perf_counter()
        fresh.goto(url, wait_until="load")
        wall = time.perf_counter() - t0
        marks = fresh.evaluate(
            "() => [performance.getEntriesByName('dashboard-rendered')[0]"
            ".startTime, (performance.getEntriesByName("
            "'first-contentful-paint')[0] || {startTime: null}).startTime, "
            "document.querySelectorAll('#devices tbody tr').length]")
        paints.append({"rendered_s": round(marks[0] / 1000, 3),
                       "fcp_s": None if marks[1] is None else round(marks[1] / 1000, 3),
                       "goto_s": round(wall, 3), "rows": marks[2]})
        fresh.close()
    return paints


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--job-duration-s", type=float, default=0.05)
    ap.add_argument("--pairs", type=int, default=6,
                    help="rollouts with the dashboard and without, in ABBA order")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per rollout")
    a = parse_args(ap, {"devices": 20, "pairs": 1})
    if shutil.which("mosquitto") is None:
        print("mosquitto is not installed: apt-get install mosquitto", file=sys.stderr)
        return 1
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: apt-get install chromium (make services)",
              file=sys.stderr)
        return 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = a.devices + 1000
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    print(cpu_line())
    work = Path(tempfile.mkdtemp(prefix="dashboard-bench-"))
    logs = work / "logs"
    logs.mkdir()
    db = str(work / "fleet.db")
    setup = start_single(work, a.devices, 1)
    procs: list[Proc] = []
    runs: list[dict[str, Any]] = []
    try:
        online = start_sims(setup, work, a.job_duration_s)
        print(f"{a.devices} simulated devices online in {online:.1f} s")
        base = [sys.executable, "-m", "fleet.cli", *setup.login, "--db", db, "--report-dir",
                str(work / "reports"), "-q"]
        ctl = Proc.spawn("controller", [*base, "controller", "--forever"], logs)
        procs.append(ctl)
        time.sleep(1.0)
        warm = rollout(base, logs, db, "warm-up", 2, a.timeout_s)
        print(f"warm-up (not counted): {warm}")
        version = 3
        for i in range(a.pairs):
            for dashed in ((False, True) if i % 2 == 0 else (True, False)):
                name = f"{'with' if dashed else 'without'}-{i}"
                r = (with_dashboard(base, logs, db, name, version, a, paints=not runs or
                                    "first_paint" not in runs[0]) if dashed
                     else rollout(base, logs, db, name, version, a.timeout_s))
                r["dashboard"] = dashed
                version += 1
                runs.append(r)
                print(f"{name}: {({k: v for k, v in r.items() if k != 'first_paint'})}",
                      flush=True)
    finally:
        for p in procs:
            if p.rc is None:
                p.popen.terminate()
                p.reap(True)
        stop_sims(setup, work)
        setup.stop()
        shutil.rmtree(work, ignore_errors=True)
    with_s = [r["rollout_s"] for r in runs if r["dashboard"]]
    without_s = [r["rollout_s"] for r in runs if not r["dashboard"]]
    ratio = statistics.median(with_s) / statistics.median(without_s)
    paints = next(r["first_paint"] for r in runs if "first_paint" in r)
    paint = max(x["rendered_s"] for x in paints)
    lags = [v for r in runs if r["dashboard"] for v in r["lag_s"].values()]
    worst_lag = max(lags) if lags else float("nan")
    dash_cpu = [r["dashboard_cpu_s"] for r in runs if r["dashboard"]]
    browser_cpu = [r["browser_cpu_s"] for r in runs if r["dashboard"]]
    print(f"first paint (3 fresh loads): {paints}")
    print(f"rollout s without the dashboard: {without_s}  (median "
          f"{statistics.median(without_s):.2f})")
    print(f"rollout s with the dashboard open: {with_s}  (median "
          f"{statistics.median(with_s):.2f})")
    print(f"during a rollout with it: the dashboard process {statistics.median(dash_cpu):.2f} "
          f"CPU s, the browser {statistics.median(browser_cpu):.2f} CPU s (medians)")
    print(json.dumps({"devices": a.devices, "runs": runs, "rollout_ratio": round(ratio, 3),
                      "first_paint_worst_s": paint, "lag_worst_s": worst_lag}))
    verdict(f"controller rollout time with the dashboard open / without ({a.devices} devices, "
            f"medians of {a.pairs})", ratio, "<=", OVERHEAD_X, "x",
            also=[(f"first paint {paint:.3f} s <= {FIRST_PAINT_S:g} s", paint <= FIRST_PAINT_S),
                  (f"live lag {worst_lag:.3f} s <= {LAG_S:g} s", worst_lag <= LAG_S)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
