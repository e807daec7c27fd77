"""Fleet rollout benchmark: deploy rollouts to simulated devices on loopback, past one machine.

Each rollout runs through the real ``fleetctl`` (its own processes, so their CPU seconds and
peak RSS are their own, from ``os.wait4``) against real mosquitto, with the simulated devices
in processes of their own (``python -m fleet.sim``: one selector thread, one MQTT client per
device). With no option it is today's benchmark: 1,000 devices on one mosquitto, one wave of
100%, no bake, ``fleetctl rollout create`` on SQLite. Printed per configuration:

- wall time of the controller processes (start, discovery, rollout, report) beside the 60 s
  target, the rollout alone (first send to last result, from the db), and where the time
  goes: start + discovery (to the rollout's row), created -> first send, first send -> last
  result (and each wave), last result -> exit (report JSON + PNG, disconnect);
- broker messages and bytes per device, in and out, from mosquitto's ``$SYS`` counters (of
  the core broker, where the controllers connect; of the regions too in a tier), beside the
  contract's floor (command, ACCEPTED, IN_PROGRESS, SUCCEEDED, model_committed = 5 PUBLISH
  in; mosquitto 2.0's publish counter skips retained messages, so the new retained status
  is in the bytes only);
- controller CPU seconds (user + system of every controller process), per device, and
  against wall time; peak RSS.

Options, for the issue "fleet past one machine" (side by side in one run, with ratios):

- ``--tier``: ``fleetctl broker-config --core`` writes a core broker and two regional ones
  (eu, us: half the devices each, one account per device); devices connect to their region,
  fleetctl to the core (with ``--inventory``). The time broker-config takes is printed.
- ``--engines sqlite,postgresql,replicas``: one controller on SQLite, one on PostgreSQL, two
  replicas on PostgreSQL (``rollout create --detach``, then two bounded ``fleetctl
  controller``; the run ends when both have exited). Each rollout deploys a new version to
  the same devices.
- ``--kill``: two replicas again, the lease holder SIGKILLed as the last wave goes out: time
  to take over (<= --lease-s + 5 s), results lost (every device SUCCEEDED at attempt 1) and
  executions duplicated (the sims' summaries: no device ran a rollout's job twice).
- ``--scale 1000,3000,10000``: all of the above at each size (fresh brokers and devices per
  size), and the controller's CPU per device as the fleet grows (target flat: CPU per
  device, and the marginal CPU per added device, each <= 1.5x the first size's).

    python benchmarks/fleet.py                # 1,000 devices, today's figures
    python benchmarks/fleet.py --devices 10000 --tier --engines sqlite,postgresql,replicas --kill
    python benchmarks/fleet.py --scale 1000,3000,10000 --tier
    python benchmarks/fleet.py --quick        # 20 devices: it runs, its figures mean nothing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.fleet_tier import (  # noqa: E402
    REGIONS,
    SYS_TOPICS,
    LeaseWatch,
    Proc,
    Setup,
    broker_counters,
    executions_of,
    rollout_facts,
    start_sims,
    start_single,
    start_tier,
    stop_sims,
    wait_topics,
)
from benchmarks.harness import parse_args, verdict  # noqa: E402
from tests.support.postgres import PostgresServer, postgres_server  # noqa: E402

TARGET_WALL_S = 60.0
FLOOR_MSGS_IN = 5  # non-retained PUBLISH per device, see the docstring
FLAT_RATIO = 1.5
"""The cost curve is flat when CPU per device at each size is <= this times the first's."""
ENGINES = ("sqlite", "postgresql", "replicas")


def run_config(a: argparse.Namespace, cfg: str, n: int, setup: Setup, work: Path,
               pg: PostgresServer | None, waves: str, version: int) -> dict[str, Any]:
    """One rollout of ``deploy v<version>`` to every device under configuration ``cfg``
    (sqlite, postgresql, replicas, kill)."""
    replicas = cfg in ("replicas", "kill")
    if cfg == "sqlite":
        db = str(work / "sqlite.db")
    else:
        assert pg is not None
        db = pg.new_database("bench")
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    opts = ["--db", db, "--report-dir", str(work / "reports"), "-q", "--lease-s", str(a.lease_s)]
    base = [sys.executable, "-m", "fleet.cli", *setup.login, *opts]
    create = [*base, "rollout", "create", "--name", f"bench-{cfg}", "--group", "sim", "--job",
              "deploy", "--args", json.dumps({"version": f"v{version}"}), "--waves", waves,
              "--bake-s", "0", *(["--detach"] if replicas else [])]
    t0 = time.time()
    procs = [Proc.spawn(f"{cfg}-create", create, logs)]
    if replicas:  # the replicas start as soon as the rollout exists (its JSON line)
        while not procs[0].out.read_bytes().endswith(b"\n") and not procs[0].reap(False):
            time.sleep(0.02)
        logins = setup.replica_logins or [setup.login, setup.login]
        procs += [Proc.spawn(f"{cfg}-replica{i}", [sys.executable, "-m", "fleet.cli",
                                                   *logins[i], *opts, "controller"], logs)
                  for i in (0, 1)]
    procs[0].reap(True)
    row: dict[str, Any] = {"devices": n, "config": cfg, "waves": waves,
                           "engine": "sqlite" if cfg == "sqlite" else "postgresql",
                           "controllers": 2 if replicas else 1}
    try:
        rid = str(procs[0].first_json()["rollout"])
    except (IndexError, ValueError, KeyError):
        for p in procs[1:]:
            p.popen.kill()
            p.reap(True)
        print(procs[0].tail(), file=sys.stderr)
        return {**row, "error": f"rollout create exited {procs[0].rc}"}
    if replicas:
        row |= drive_replicas(a, procs[1:], db, rid, kill=cfg == "kill")
    end = max(p.ended for p in procs)
    for p in procs:
        if p.rc != 0 and p.name != row.get("killed"):
            print(f"{p.name} exited {p.rc}:\n{p.tail()}", file=sys.stderr)
            row.setdefault("error", f"{p.name} exited {p.rc}")
    f = rollout_facts(db, rid)
    cpu = sum(p.cpu_s for p in procs)
    wall = end - t0
    first, last = f["first_sent"] or end, f["last_result"] or end
    row |= {
        "state": f["state"], "key": f["key"], "succeeded": f["succeeded_devices"],
        "lost": n - f["succeeded_devices"], "max_attempt": f["max_attempt"],
        "wall_s": round(wall, 2), "rollout_s": round(last - first, 2),
        "phases_s": {"start_discovery": round(f["created_at"] - t0, 2),
                     "created_to_first_send": round(first - f["created_at"], 2),
                     "first_send_to_last_result": round(last - first, 2),
                     "last_result_to_exit": round(end - last, 2)},
        "wave_sizes": f["wave_sizes"], "wave_s": f["wave_s"],
        "controller_cpu_s": round(cpu, 2),
        "controller_user_s": round(sum(p.user_s for p in procs), 2),
        "controller_sys_s": round(sum(p.sys_s for p in procs), 2),
        "cpu_ms_per_device": round(1000 * cpu / n, 3),
        "cpu_per_wall": round(cpu / wall, 2),
        "controller_peak_rss_mb": round(max(p.rss_mb for p in procs)),
        "cpu_s_by_process": {p.name: round(p.cpu_s, 2) for p in procs},
        "exit_after_last_result_s": {p.name: round(p.ended - last, 2) for p in procs},
    }
    return row


def drive_replicas(a: argparse.Namespace, reps: list[Proc], db: str, rid: str,
                   kill: bool) -> dict[str, Any]:
    """Until both replicas have exited; with ``kill``, SIGKILL the lease holder as soon as the
    last wave is in flight and time the survivor's takeover of the lease."""
    out: dict[str, Any] = {}
    watch = LeaseWatch(db, rid) if kill else None
    deadline = time.monotonic() + a.timeout_s
    killed_at: float | None = None
    survivor: Proc | None = None
    try:
        while not all([p.reap(False) for p in reps]):
            if time.monotonic() > deadline:
                for p in reps:
                    if p.rc is None:
                        p.popen.kill()
                out["error"] = f"replicas still running after {a.timeout_s:.0f} s"
                for p in reps:
                    p.reap(True)
                break
            if watch is not None and killed_at is None:
                owner = watch.owner()
                sent, open_, done = watch.last_wave_progress() if owner else (0, 0, 0)
                victim = next((p for p in reps if owner and owner.endswith(f"-{p.popen.pid}")),
                              None)
                if victim is not None and sent and open_:
                    os.kill(victim.popen.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                    survivor = next(p for p in reps if p is not victim)
                    out |= {"killed": victim.name, "open_at_kill": open_,
                            "last_wave_done_at_kill": done, "takeover_s": None}
            elif watch is not None and survivor is not None and out["takeover_s"] is None:
                owner = watch.owner()
                if owner and owner.endswith(f"-{survivor.popen.pid}"):
                    assert killed_at is not None
                    out["takeover_s"] = round(time.monotonic() - killed_at, 2)
            time.sleep(0.05)
    finally:
        if watch is not None:
            watch.close()
    if kill and killed_at is None:
        out.setdefault("error", "the rollout ended before its last wave was seen in flight")
    return out


def run_size(a: argparse.Namespace, n: int, cfgs: list[str], work: Path,
             pg: PostgresServer | None, waves: str) -> list[dict[str, Any]]:
    """Brokers and ``n`` devices, then one rollout per configuration, then the sims'
    summaries: which device ran which job id."""
    work.mkdir(parents=True)
    setup = (start_tier(work, n, a.sim_procs, work.parent / "secrets") if a.tier
             else start_single(work, n, a.sim_procs))
    rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    try:
        if setup.broker_config_s is not None:
            print(f"fleetctl broker-config --core for {n} devices: {setup.broker_config_s:.1f} s"
                  f" (of which parsing the inventory YAML ~{setup.inventory_parse_s:.1f} s, "
                  "paid again by every fleetctl given --inventory)")
        online_s = start_sims(setup, work, a.job_duration_s)
        print(f"{n} simulated devices online in {online_s:.1f} s", end="")
        seen_s = wait_topics(setup.brokers["core"], "fleet/v1/dev/+/status", n, b'"online"',
                             120)
        print(f"; all {n} online statuses at the core {seen_s:.1f} s later")
        before = broker_counters(setup.brokers)
        for i, cfg in enumerate(cfgs):
            row = run_config(a, cfg, n, setup, work, pg, waves, version=2 + i)
            after = broker_counters(setup.brokers)
            row |= per_device(before, after, n)
            before = after
            rows.append(row)
    finally:
        summaries = stop_sims(setup, work)
        setup.stop()
    answers = sum(int(s.get("duplicates", 0)) for s in summaries)
    for row in rows:
        runs = executions_of(summaries, row.get("key", "?"))
        row["ran_once"] = sum(len(ids) == 1 for ids in runs.values())
        row["executions_duplicated"] = sum(len(ids) - 1 for ids in runs.values())
        row["duplicate_answers_at_size"] = answers
        print_row(a, row)
    print(f"\nDUPLICATE answers from the devices at {n} (all runs together; the kill run's "
          f"survivor re-sends every open execution): {answers}")
    return rows


def per_device(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
               n: int) -> dict[str, Any]:
    """Counter deltas per device: the core's (today's names), the regions' summed."""
    d = {b: {k: after[b].get(k, 0) - before[b].get(k, 0) for k in SYS_TOPICS.values()}
         for b in after}
    core = d["core"]
    out: dict[str, Any] = {f"{k}_per_device": round(core[k] / n, 2) for k in
                           ("msgs_in", "msgs_out", "packets_in", "packets_out")}
    out |= {f"{k}_per_device": round(core[k] / n) for k in ("bytes_in", "bytes_out")}
    regions = [b for b in d if b in REGIONS]
    if regions:
        for k in ("msgs_in", "msgs_out", "bytes_in", "bytes_out"):
            out[f"regions_{k}_per_device"] = round(sum(d[r][k] for r in regions) / n, 2)
    return out


def misses(a: argparse.Namespace, row: dict[str, Any]) -> list[str]:
    """The targets this configuration missed."""
    n, out = row["devices"], []
    if "error" in row:
        out.append(row["error"])
    if row.get("succeeded") != n or row.get("state") != "succeeded":
        out.append(f"{row.get('succeeded')}/{n} succeeded, state {row.get('state')}")
    if row.get("wall_s", 1e9) > TARGET_WALL_S:
        out.append(f"wall {row.get('wall_s')} s > {TARGET_WALL_S:.0f} s")
    if row.get("max_attempt", 1) > 1:
        out.append(f"an attempt {row['max_attempt']} (a retry with a new id)")
    if row.get("ran_once") != n or row.get("executions_duplicated"):
        out.append(f"{row.get('ran_once')}/{n} devices ran the job exactly once, "
                   f"{row.get('executions_duplicated')} duplicated")
    if row["config"] == "kill":
        t = row.get("takeover_s")
        if t is None or t > a.lease_s + 5:
            out.append(f"takeover {t} s > lease {a.lease_s:g} + 5 s")
    return out


def print_row(a: argparse.Namespace, r: dict[str, Any]) -> None:
    n = r["devices"]
    print(f"\n== {r['config']} ({r['engine']}, {r['controllers']} controller process"
          f"{'es' if r['controllers'] > 1 else ''}), {n} devices, waves {r['waves']} ==")
    if "wall_s" not in r:
        print(f"failed: {r.get('error')}")
        return
    what = ("fleetctl rollout create --detach + 2 fleetctl controller" if r["controllers"] > 1
            else "fleetctl rollout create")
    ph = r["phases_s"]
    print(f"rollout: {r['succeeded']}/{n} SUCCEEDED, state {r['state']}")
    print(f"{what} wall: {r['wall_s']:.2f} s  (target <= {TARGET_WALL_S:.0f} s, "
          f"ratio {r['wall_s'] / TARGET_WALL_S:.2f})")
    print(f"  of which first send -> last result: {r['rollout_s']:.2f} s")
    print(f"  where the time goes: start + discovery {ph['start_discovery']:.2f} s, created -> "
          f"first send {ph['created_to_first_send']:.2f} s, first send -> last result "
          f"{ph['first_send_to_last_result']:.2f} s, last result -> exit (report, "
          f"disconnect) {ph['last_result_to_exit']:.2f} s; waves of "
          f"{'/'.join(map(str, r['wave_sizes']))} devices took "
          f"{'/'.join(str(w) for w in r['wave_s'])} s")
    print(f"broker per device: {r['msgs_in_per_device']:.2f} non-retained msgs in (floor "
          f"{FLOOR_MSGS_IN}, ratio {r['msgs_in_per_device'] / FLOOR_MSGS_IN:.2f}), "
          f"{r['msgs_out_per_device']:.2f} msgs out (PUBLISH); all packets incl. PUBACK "
          f"{r['packets_in_per_device']:.2f} in, {r['packets_out_per_device']:.2f} out; "
          f"{r['bytes_in_per_device']:.0f} B in, {r['bytes_out_per_device']:.0f} B out")
    if "regions_msgs_in_per_device" in r:
        print(f"regional brokers per device (both): {r['regions_msgs_in_per_device']:.2f} msgs"
              f" in, {r['regions_msgs_out_per_device']:.2f} out; "
              f"{r['regions_bytes_in_per_device']:.0f} B in, "
              f"{r['regions_bytes_out_per_device']:.0f} B out")
    procs = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s_by_process"].items())
    print(f"controller: {r['controller_cpu_s']:.2f} CPU s ({r['controller_user_s']:.2f} user + "
          f"{r['controller_sys_s']:.2f} sys; {procs}), {r['cpu_ms_per_device']:.2f} ms per "
          f"device, {r['cpu_per_wall']:.2f} CPU s per wall s, peak RSS "
          f"{r['controller_peak_rss_mb']:.0f} MB")
    if r["config"] == "kill":
        print(f"kill: {r.get('killed')} (the lease holder) SIGKILLed with "
              f"{r.get('open_at_kill')} executions of the last wave open; survivor took the "
              f"lease {r.get('takeover_s')} s later (target <= {a.lease_s:g} + 5 s)")
    print(f"devices that ran the job exactly once: {r['ran_once']}/{n}, executions duplicated "
          f"{r['executions_duplicated']}, results lost {r['lost']}, highest attempt "
          f"{r['max_attempt']}")


def print_summary(a: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The side-by-side table (ratios to the first configuration at each size) and, with
    several sizes, the cost curve per configuration."""
    head = (f"{'devices':>7} {'config':<10} {'wall s':>7} {'x base':>6} {'rollout s':>9} "
            f"{'disc s':>6} {'tail s':>6} {'CPU s':>6} {'x base':>6} {'ms/dev':>6} "
            f"{'CPU/wall':>8} {'msg in/out':>10} {'ok':>11} {'takeover':>8} {'lost':>4} "
            f"{'dup':>4}  missed")
    print("\n" + head)
    base: dict[int, dict[str, Any]] = {}
    for r in rows:
        b = base.setdefault(r["devices"], r)
        miss = misses(a, r)
        if "wall_s" not in r:
            print(f"{r['devices']:>7} {r['config']:<10} {'-':>7}  missed: {'; '.join(miss)}")
            continue
        r["wall_x_base"] = round(r["wall_s"] / b["wall_s"], 2) if "wall_s" in b else None
        r["cpu_x_base"] = (round(r["controller_cpu_s"] / b["controller_cpu_s"], 2)
                           if "wall_s" in b else None)
        r["missed"] = miss
        msgs = f"{r['msgs_in_per_device']:.1f}/{r['msgs_out_per_device']:.1f}"
        ok = f"{r['succeeded']}/{r['devices']}"
        take = "-" if r["config"] != "kill" else str(r.get("takeover_s"))
        print(f"{r['devices']:>7} {r['config']:<10} {r['wall_s']:>7.2f} {r['wall_x_base']:>6} "
              f"{r['rollout_s']:>9.2f} {r['phases_s']['start_discovery']:>6.2f} "
              f"{r['phases_s']['last_result_to_exit']:>6.2f} {r['controller_cpu_s']:>6.2f} "
              f"{r['cpu_x_base']:>6} {r['cpu_ms_per_device']:>6.2f} {r['cpu_per_wall']:>8.2f} "
              f"{msgs:>10} {ok:>11} {take:>8} {r['lost']:>4} {r['executions_duplicated']:>4}  "
              f"{'; '.join(miss) or '-'}")
    curve: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "cpu_ms_per_device" in r:
            curve.setdefault(r["config"], []).append(r)
    out: dict[str, Any] = {}
    if len({r["devices"] for r in rows}) > 1:
        print(f"\ncontroller CPU per device as the fleet grows (target flat: each <= "
              f"{FLAT_RATIO}x the first size's; marginal = extra CPU per extra device, which "
              "leaves out the fixed start-up cost, and its ratio to the first marginal, also "
              f"<= {FLAT_RATIO}x)")
        for cfg, rs in curve.items():
            first = rs[0]["cpu_ms_per_device"]
            pts: list[dict[str, Any]] = []
            for i, r in enumerate(rs):
                m = None if i == 0 else round(
                    1000 * (r["controller_cpu_s"] - rs[i - 1]["controller_cpu_s"])
                    / (r["devices"] - rs[i - 1]["devices"]), 3)
                m0 = pts[1]["marginal_ms_per_device"] if i > 1 else None
                pts.append({"devices": r["devices"], "cpu_ms_per_device": r["cpu_ms_per_device"],
                            "ratio": round(r["cpu_ms_per_device"] / first, 2),
                            "marginal_ms_per_device": m,
                            "marginal_ratio": round(m / m0, 2)
                            if m is not None and m0 is not None and m0 > 0 else None})
            out[cfg] = pts
            print(f"  {cfg:<10} " + "  ".join(
                f"{p['devices']}: {p['cpu_ms_per_device']:.2f} ms (x{p['ratio']:.2f}"
                + ("" if p["marginal_ms_per_device"] is None else
                   f", marginal {p['marginal_ms_per_device']:.2f} ms") +
                ("" if p["marginal_ratio"] is None else f" x{p['marginal_ratio']:.2f}") + ")"
                for p in pts))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--scale", help="comma-separated fleet sizes (instead of --devices): the "
                                    "controller's cost curve")
    ap.add_argument("--tier", action="store_true",
                    help="a core broker and two bridged regional brokers (broker-config --core)")
    ap.add_argument("--engines", default="sqlite",
                    help=f"comma-separated, of {', '.join(ENGINES)} (default sqlite)")
    ap.add_argument("--kill", action="store_true",
                    help="also two replicas with the lease holder SIGKILLed mid-rollout")
    ap.add_argument("--waves", help="default 100%% with no option above, else 1%%,10%%,100%%")
    ap.add_argument("--lease-s", type=float, default=5.0, help="the replicas' --lease-s")
    ap.add_argument("--sim-procs", type=int, default=1,
                    help="simulated device processes per broker (per region in a tier)")
    ap.add_argument("--job-duration-s", type=float, default=0.05)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per configuration")
    a = parse_args(ap, {"devices": 20})
    sizes = [int(x) for x in a.scale.split(",")] if a.scale else [a.devices]
    cfgs = [e.strip() for e in a.engines.split(",") if e.strip()]
    if bad := [e for e in cfgs if e not in ENGINES]:
        ap.error(f"--engines: unknown {bad[0]!r}; known: {', '.join(ENGINES)}")
    cfgs += ["kill"] if a.kill else []
    simple = not (a.scale or a.tier or a.kill or cfgs != ["sqlite"])
    waves = a.waves or ("100%" if simple else "1%,10%,100%")
    if shutil.which("mosquitto") is None:
        print("mosquitto is not installed: apt-get install mosquitto", file=sys.stderr)
        return 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(sizes) + 1000  # one broker (or sim process) holds every device's socket
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
        if hard < need:
            print(f"RLIMIT_NOFILE hard limit {hard} < {need}: ulimit -n", file=sys.stderr)
            return 1
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    rows: list[dict[str, Any]] = []
    try:
        with contextlib.ExitStack() as stack:
            pg = (stack.enter_context(postgres_server()) if any(c != "sqlite" for c in cfgs)
                  else None)
            for n in sizes:
                rows += run_size(a, n, cfgs, work / f"n{n}", pg, waves)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    curve = print_summary(a, rows)
    missed = any(r.get("missed", True) for r in rows) or any(
        p["ratio"] > FLAT_RATIO or (p.get("marginal_ratio") or 0) > FLAT_RATIO
        for pts in curve.values() for p in pts)
    keep = ("devices", "wall_s", "rollout_s", "msgs_in_per_device", "msgs_out_per_device",
            "bytes_in_per_device", "bytes_out_per_device", "controller_cpu_s",
            "controller_peak_rss_mb")
    if simple and len(rows) == 1 and "wall_s" in rows[0]:
        r = rows[0]
        print(json.dumps({**{k: r[k] for k in keep}, **{k: v for k, v in r.items()
                                                          if k not in keep}}))
    else:
        print(json.dumps({"runs": rows, "cost_curve": curve, "lease_s": a.lease_s,
                          "broker": "tier" if a.tier else "single", "targets_met": not missed}))
    walls = [r for r in rows if "wall_s" in r]
    slowest = max(walls, key=lambda r: r["wall_s"]) if walls else None
    also = [(f"{r['config']} at {r['devices']}: {'; '.join(r.get('missed') or ['failed'])}",
             not r.get("missed", True)) for r in rows]
    also += [(f"{cfg} CPU per device flat", all(
        p["ratio"] <= FLAT_RATIO and (p.get("marginal_ratio") or 0) <= FLAT_RATIO for p in pts))
        for cfg, pts in curve.items()]
    verdict(f"fleetctl rollout wall time (slowest: "
            f"{slowest['config'] if slowest else 'none'} at {max(sizes)} devices)",
            slowest["wall_s"] if slowest else float("nan"), "<=", TARGET_WALL_S, "s",
            also=also)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
