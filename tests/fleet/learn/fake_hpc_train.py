"""A stand-in for ``hpc-train aggregate`` and ``hpc-train publish`` that ``fleetctl learn``
runs through ``--hpc-train`` in the round-logic tests: same arguments, same exit codes, same
report files (``aggregate.json``, ``gates.json``), no tensors. Every call is appended to
``$FAKE_HPC_TRAIN_LOG`` (one JSON line), so a test can count what ran.

- aggregate: combines every ``--updates`` version (exit 1 below ``--min-updates``); the
  folder appears by rename, as the real one's does. ``$FAKE_HPC_TRAIN_SLEEP_S`` slows it.
- ``$FAKE_HPC_TRAIN_FAIL=TOOL:CODE`` makes that tool (aggregate, publish) fail with that exit
  code, as a bad option or key would.
- publish: the device gates from the real ``--device-evals`` file (read by the real
  ``load_device_evals``, so its format is checked); ``--max-upstream-drop`` fails when
  ``$FAKE_UPSTREAM_DROP_PTS`` exceeds it; versions are recorded in
  ``REGISTRY/fake-published.json`` and a second publish of one is refused as the real one is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _log(argv: list[str]) -> None:
    path = os.environ.get("FAKE_HPC_TRAIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"argv": argv, "pid": os.getpid(), "t": time.time()}) + "\n")


def aggregate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    for flag in ("--registry", "--model", "--base", "--strategy", "--trusted-keys", "--out",
                 "--updates", "--trim", "--krum-f", "--krum-keep", "--clip-norm"):
        ap.add_argument(flag)
    ap.add_argument("--min-updates", type=int, default=2)
    ap.add_argument("--max-staleness", type=int, default=0)
    a = ap.parse_args(argv)
    time.sleep(float(os.environ.get("FAKE_HPC_TRAIN_SLEEP_S", "0")))
    updates = [v for v in a.updates.split(",") if v]
    if len(updates) < a.min_updates:
        print(f"aggregate: {len(updates)} usable update(s) of {a.model}@{a.base}, "
              f"{a.min_updates} needed; nothing written", file=sys.stderr)
        return 1
    out = Path(a.out)
    if out.exists():
        print(f"aggregate: --out {out} exists", file=sys.stderr)
        return 2
    tmp = out.parent / f".tmp-{out.name}.{os.getpid()}"
    tmp.mkdir(parents=True)
    (tmp / "aggregate.json").write_text(json.dumps({
        "model": a.model, "base": {"version": a.base, "sequence": 1}, "strategy": a.strategy,
        "combined": updates, "skipped": [], "max_staleness": a.max_staleness}))
    (tmp / "COMPLETE").write_text("fake\n")
    os.rename(tmp, out)
    print(f"aggregated {len(updates)} updates into {out}")
    return 0


def publish(argv: list[str]) -> int:
    from hpc_core.aggregation.device_evals import load_device_evals

    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    for flag in ("--registry", "--name", "--version", "--sign-key", "--artefact",
                 "--device-evals", "--base-checkpoint", "--eval-config", "--gain-mean"):
        ap.add_argument(flag)
    for flag in ("--min-mean-gain", "--max-device-drop", "--max-upstream-drop"):
        ap.add_argument(flag, type=float)
    ap.add_argument("--min-devices", type=int)
    a = ap.parse_args(argv)
    gates = []
    if a.max_upstream_drop is not None:
        drop = float(os.environ.get("FAKE_UPSTREAM_DROP_PTS", "0"))
        gates.append({"flag": f"--max-upstream-drop {a.max_upstream_drop:g}",
                      "passed": drop <= a.max_upstream_drop,
                      "detail": f"held-out accuracy dropped {drop:g} pts"})
    if a.device_evals:
        rows = load_device_evals(Path(a.device_evals)).evaluations
        if a.min_devices is not None:
            gates.append({"flag": f"--min-devices {a.min_devices}",
                          "passed": len(rows) >= a.min_devices,
                          "detail": f"{len(rows)} device evaluation(s)"})
        if a.max_device_drop is not None:
            worse = [e for e in rows if -e.gain_pts > a.max_device_drop + 1e-9]
            gates.append({"flag": f"--max-device-drop {a.max_device_drop:g}",
                          "passed": not worse,
                          "detail": "; ".join(f"{e.device} dropped {-e.gain_pts:.3g} pts"
                                              for e in worse) or "no device dropped"})
        if a.min_mean_gain is not None:
            mean = sum(e.gain_pts for e in rows) / len(rows) if rows else float("-inf")
            gates.append({"flag": f"--min-mean-gain {a.min_mean_gain:g}",
                          "passed": mean >= a.min_mean_gain - 1e-9,
                          "detail": f"mean gain {mean:+.3g} pts"})
    source = Path(a.source)
    if gates:
        passed = all(g["passed"] for g in gates)
        (source / "gates.json").write_text(json.dumps({
            "passed": passed, "gates": gates,
            "failures": [f"{g['flag']}: {g['detail']}" for g in gates if not g["passed"]]}))
        if not passed:
            print("publish: refused by gates, nothing published", file=sys.stderr)
            return 4
    record = Path(a.registry) / "fake-published.json"
    done = json.loads(record.read_text()) if record.exists() else []
    if a.version in done:
        print(f"publish: {a.name}@{a.version} already exists in file://{a.registry}; versions "
              "are immutable, pick a new version", file=sys.stderr)
        return 2
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps([*done, a.version]))
    print(f"published {a.name}@{a.version}")
    return 0


def main(argv: list[str]) -> int:
    _log(argv)
    cmd, rest = argv[0], argv[1:]
    fail = os.environ.get("FAKE_HPC_TRAIN_FAIL", "")
    if fail == f"{cmd}:crash":
        raise RuntimeError("simulated crash")
    if fail.startswith(f"{cmd}:"):
        print(f"{cmd}: simulated failure: --trusted-keys holds no key", file=sys.stderr)
        return int(fail.split(":")[1])
    return aggregate(rest) if cmd == "aggregate" else publish(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
