"""Fleet aggregation benchmark: `hpc-train aggregate` per strategy vs reading the same bytes.

A temporary folder registry gets a random float32 base (``--params`` parameters in
``--tensors`` tensors) and ``--updates-count`` device fine-tunes of it (base + random delta),
all signed by one generated device key, as ``agentctl upload`` signs them. Then, per strategy,
side by side on a warm page cache:

* baseline: a loop that reads every chunk file of the base and the updates once (what ``cat``
  does), and the same loop hashing each chunk (what any verifying reader must at least do);
* ``run_round`` in a fresh process (every update verified, measured and combined), its wall
  time and its peak RSS growth over the process's RSS after imports.

``--cache cold`` drops the chunk files from the page cache before each of the three, so
each reads from the disk (the target compares with that); the default, warm, reads
everything once before each.

Printed: time ratio to the plain read (target <= 2x) and to the hashing read, and peak RSS
growth over the model's size (target <= 3x).

    python benchmarks/aggregate.py                                   # 100 x 25 M parameters
    python benchmarks/aggregate.py --updates-count 10 --params 5e6   # quick
    python benchmarks/aggregate.py --cache cold                      # from the disk
    python benchmarks/aggregate.py --quick        # a few seconds: it runs, figures mean nothing
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import parse_args, verdict  # noqa: E402
from registry.chunks import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_BELOW  # noqa: E402
from registry.manifest import Manifest  # noqa: E402
from registry.names import chunk_key  # noqa: E402
from tests.support.fleet_registry import FleetRegistry  # noqa: E402

STRATEGIES = ("fedavg", "trimmed-mean", "median", "krum")
DEVICE = "bench-device"

CHILD = """
import json, sys, time
from pathlib import Path
import numpy as np
from hpc_core.aggregation.options import Options
from hpc_core.aggregation.round import run_round
args = json.loads(sys.argv[1])
def status(field):  # bytes; VmHWM: this process's peak RSS
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024
# Baseline: the RSS now (an import's passing peak must not hide what the run adds). Peak:
# VmHWM, not getrusage's ru_maxrss, which Linux carries over fork and exec from the parent
# (a pytest process that holds torch would read as this child's peak).
before = status("VmRSS")
start = time.perf_counter()
report = run_round(Options(registry=args["registry"], model="bench", base="1",
                           strategy=args["strategy"], trusted_keys=Path(args["trusted"]),
                           out=Path(args["out"]), min_updates=1,
                           krum_f=args["krum_f"], block_mb=args["block_mb"]))
seconds = time.perf_counter() - start
after = status("VmHWM")
print(json.dumps({"seconds": seconds, "rss_growth_bytes": after - before,
                  "combined": len(report["combined"]), "torch": "torch" in sys.modules}))
"""


def build(where: Path, n: int, params: int, tensors: int, seed: int) -> tuple[FleetRegistry,
                                                                             list[Manifest]]:
    fleet = FleetRegistry.create(where, name="bench", chunk_size=DEFAULT_CHUNK_SIZE,
                                 pack_below=DEFAULT_PACK_BELOW)
    rng = np.random.default_rng(seed)
    cols = 1024
    rows = max(1, params // (tensors * cols))
    base = {f"layer{i:02d}.weight": rng.standard_normal((rows, cols), dtype=np.float32)
            for i in range(tensors)}
    release = fleet.release("1", base)
    versions = [release]
    key = fleet.device(DEVICE)
    for i in range(n):
        update = {k: v + rng.standard_normal(v.shape, dtype=np.float32) * np.float32(0.01)
                  for k, v in base.items()}
        versions.append(fleet.update(key, release, update))
        for scratch in fleet.work.glob("*.safetensors"):
            scratch.unlink()  # the registry holds the bytes now
        print(f"\rpublished {i + 1}/{n} updates", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return fleet, versions


def evict(fleet: FleetRegistry, versions: list[Manifest]) -> None:
    """Drop these versions' chunk files from the page cache (POSIX_FADV_DONTNEED; no root
    needed): the next read comes from the disk."""
    os.sync()  # dirty pages are not dropped
    for m in versions:
        for c in m.chunks:
            fd = os.open(fleet.store.path(chunk_key(c.sha256)), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_all(fleet: FleetRegistry, versions: list[Manifest], *, hashing: bool) -> float:
    """Seconds to read (and optionally sha256) every chunk of these versions once."""
    buf = memoryview(bytearray(1 << 20))
    start = time.perf_counter()
    for m in versions:
        for c in m.chunks:
            h = hashlib.sha256() if hashing else None
            with open(fleet.store.path(chunk_key(c.sha256)), "rb") as f:
                while n := f.readinto(buf):
                    if h is not None:
                        h.update(buf[:n])
    return time.perf_counter() - start


def aggregate(fleet: FleetRegistry, strategy: str, out: Path, krum_f: int,
              block_mb: float | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = {"registry": str(fleet.root), "strategy": strategy, "trusted": str(fleet.trusted),
            "out": str(out), "krum_f": krum_f, "block_mb": block_mb}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"aggregate {strategy} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates-count", type=int, default=100)
    ap.add_argument("--params", type=float, default=25e6, help="parameters of the model")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--block-mb", type=float, default=None)
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the temporary registry goes (needs N+1 models of disk)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm",
                    help="warm: every byte read once before each measurement (page cache); "
                         "cold: the chunk files dropped from the page cache before each (the "
                         "reads come from the disk)")
    args = parse_args(ap, {"updates_count": 4, "params": 2e5, "tensors": 2})
    work = Path(tempfile.mkdtemp(prefix="aggregate-bench-", dir=args.work_dir))
    try:
        t0 = time.perf_counter()
        fleet, versions = build(work / "fleet", args.updates_count, int(args.params),
                                args.tensors, args.seed)
        model_bytes = versions[0].tensor_bytes
        total = sum(m.total_bytes for m in versions)
        print(f"registry: base + {args.updates_count} updates of {model_bytes / 1e6:.1f} MB "
              f"({model_bytes // 4 / 1e6:.1f} M float32 parameters); {total / 1e9:.2f} GB "
              f"read per pass; built in {time.perf_counter() - t0:.0f} s")
        krum_f = max(0, min(2, (args.updates_count - 3) // 2))
        print(f"page cache: {args.cache} before each measurement")
        print(f"{'strategy':<13} {'aggregate s':>11} {'read s':>7} {'ratio':>6} "
              f"{'read+sha s':>10} {'ratio':>6} {'RSS growth MB':>13} {'x model':>7}")
        cold = args.cache == "cold"
        worst_time, worst_rss = 0.0, 0.0

        def cache() -> None:  # before each measurement: the same start for all three
            if cold:
                evict(fleet, versions)
            else:
                read_all(fleet, versions, hashing=False)

        for strategy in args.strategies.split(","):
            cache()
            plain = read_all(fleet, versions, hashing=False)
            cache()
            hashed = read_all(fleet, versions, hashing=True)
            cache()
            got = aggregate(fleet, strategy, work / f"out-{strategy}", krum_f, args.block_mb)
            assert got["combined"] == args.updates_count and not got["torch"]
            growth = got["rss_growth_bytes"]
            print(f"{strategy:<13} {got['seconds']:>11.2f} {plain:>7.2f} "
                  f"{got['seconds'] / plain:>5.1f}x {hashed:>10.2f} "
                  f"{got['seconds'] / hashed:>5.1f}x {growth / 1e6:>13.1f} "
                  f"{growth / model_bytes:>6.2f}x")
            worst_time = max(worst_time, got["seconds"] / plain)
            worst_rss = max(worst_rss, growth / model_bytes)
        print("targets: time <= 2x the plain read; peak RSS growth <= 3x the model")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdict(f"aggregate / plain read time (worst of {args.strategies}) ratio", worst_time, "<=",
            2.0, also=[(f"peak RSS growth {worst_rss:.2f}x the model <= 3x", worst_rss <= 3.0)])


if __name__ == "__main__":
    main()
