"""Dashboard benchmark: ``fleetctl dashboard`` over a large simulated fleet, in headless Chromium.

The fleet benchmark's set-up (``benchmarks/fleet_tier.py``: one mosquitto, the simulated
devices in a process of their own, ``python -m fleet.sim``), a ``fleetctl controller
--forever`` on SQLite, and the same rollout (``deploy``, waves 1%,10%,100%, no bake) three
times: without the dashboard, with the dashboard and a page open on it, and without again.
Printed:

- first paint: a fresh page's load to the moment the fleet is on it (the page's own
  ``dashboard-rendered`` mark: counts, the first 50 rows, the rollouts), and the browser's
  first contentful paint, target <= 2 s;
- live update lag: for each wave start and end and the rollout's end, the time the page's DOM
  showed it (a MutationObserver, ``Date.now()``) minus the time the controller recorded it
  in the db (``waves.started_at`` / ``finished_at``, ``rollouts.finished_at``): the worst,
  target <= 1 s;
- the controller's rollout time (first send to last result) with the page open over the mean
  of the two runs without, target <= 1.05x; and the dashboard process's CPU seconds.

    python benchmarks/dashboard.py              # 10,000 devices
    python benchmarks/dashboard.py --quick      # 20 devices: it runs, its figures mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--job-duration-s", type=float, default=0.05)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per rollout")
    a = parse_args(ap, {"devices": 20})
    if shutil.which("mosquitto") is None:
        print("mosquitto is not installed: apt-get install mosquitto", file=sys.stderr)
        return 1
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: apt-get install chromium (make services)",
              file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

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
    res: dict[str, Any] = {"devices": a.devices}
    try:
        online = start_sims(setup, work, a.job_duration_s)
        print(f"{a.devices} simulated devices online in {online:.1f} s")
        base = [sys.executable, "-m", "fleet.cli", *setup.login, "--db", db, "--report-dir",
                str(work / "reports"), "-q"]
        ctl = Proc.spawn("controller", [*base, "controller", "--forever"], logs)
        procs.append(ctl)
        time.sleep(1.0)
        before = rollout(base, logs, db, "plain-1", 2, a.timeout_s)
        print(f"without the dashboard: {before}")
        token = work / "operator.token"
        token.write_text(os.urandom(16).hex() + "\n")
        token.chmod(0o600)
        dash = Proc.spawn("dashboard", [*base, "dashboard", "--port", "0",
                                        "--operator-token-file", str(token)], logs)
        procs.append(dash)
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
                # The dashboard has every device's retained status before the timed load.
                page.goto(url)
                page.wait_for_function(
                    f"JSON.parse(document.querySelector('[data-count=devices] b')"
                    f".textContent) >= {a.devices}", timeout=120_000, polling=200)
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
                                   "fcp_s": None if marks[1] is None
                                   else round(marks[1] / 1000, 3),
                                   "goto_s": round(wall, 3), "rows": marks[2]})
                    fresh.close()
                res["first_paint"] = paints
                print(f"first paint (3 fresh loads): {paints}")
                page.evaluate(OBSERVER)
                during = rollout(base, logs, db, "with-page", 3, a.timeout_s)
                page.wait_for_timeout(1500)
                seen = page.evaluate("window.__seen")
                res["page_rows"] = page.locator("#devices tbody tr").count()
            finally:
                browser.close()
        print(f"with the dashboard open: {during}")
        dash.popen.terminate()  # the run after is without it again
        dash.reap(True)
        truth = db_times(db, during["id"])
        lags = {k: round(seen[k] / 1000 - t, 3) for k, t in truth.items() if k in seen}
        missing = sorted(set(truth) - set(seen))
        res["lag_s"] = lags
        res["lag_missing"] = missing
        print(f"live update lag behind the controller (DOM time - db time), s: {lags}")
        if missing:
            print(f"  never on the page (passed between two refreshes): {missing}")
        after = rollout(base, logs, db, "plain-2", 4, a.timeout_s)
        print(f"without the dashboard, again: {after}")
        res["runs"] = {"without": before, "with": during, "without_again": after}
    finally:
        for p in procs:
            if p.rc is None:
                p.popen.terminate()
                p.reap(True)
        stop_sims(setup, work)
        setup.stop()
        shutil.rmtree(work, ignore_errors=True)
    dash_cpu = next((p.cpu_s for p in procs if p.name == "dashboard"), float("nan"))
    res["dashboard_cpu_s"] = round(dash_cpu, 2)
    res["dashboard_peak_rss_mb"] = round(next(p.rss_mb for p in procs if p.name == "dashboard"))
    ref = (res["runs"]["without"]["rollout_s"] + res["runs"]["without_again"]["rollout_s"]) / 2
    ratio = res["runs"]["with"]["rollout_s"] / ref if ref > 0 else float("nan")
    paint = max(x["rendered_s"] for x in res["first_paint"])
    worst_lag = max(res["lag_s"].values()) if res["lag_s"] else float("nan")
    res |= {"rollout_ratio": round(ratio, 3), "first_paint_worst_s": paint,
            "lag_worst_s": worst_lag}
    print(f"dashboard process: {dash_cpu:.2f} CPU s over the run, peak RSS "
          f"{res['dashboard_peak_rss_mb']} MB")
    print(json.dumps(res))
    verdict(f"controller rollout time with the dashboard open / without ({a.devices} devices)",
            ratio, "<=", OVERHEAD_X, "x",
            also=[(f"first paint {paint:.3f} s <= {FIRST_PAINT_S:g} s", paint <= FIRST_PAINT_S),
                  (f"live lag {worst_lag:.3f} s <= {LAG_S:g} s", worst_lag <= LAG_S)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
