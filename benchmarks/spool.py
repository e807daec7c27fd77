"""Data spool benchmark: how fast an application can record, whether the disk bound holds
under a flood, and what eviction costs.

1. throughput: records/s sustained for one sample per call and for batches, 28x28 gray and
   32x32 RGB, below the quota (no eviction) and at it (every call evicts), with the per-call
   latency (p50/p99): every record that returns is fsynced on disk;
2. disk bound: a flood of mixed single and batched records into a small quota, the bytes the
   segment files really take (st_blocks) sampled after every call, against the quota;
3. eviction cost: a full spool's per-call latency against an empty one's, the compaction
   rewrites, opening (index rebuild from the headers) and a snapshot of the full spool.

Runs in a temporary folder on the filesystem of ``--dir`` (default: the system's temp).

    python benchmarks/spool.py                # ~1 minute
    python benchmarks/spool.py --seconds 2    # quicker
    python benchmarks/spool.py --quick        # a few seconds: it runs, its figures mean nothing
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # first: benchmarks/agent.py would shadow the package

from agent.spool.config import MB, SpoolConfig  # noqa: E402
from agent.spool.store import Spool  # noqa: E402
from benchmarks.harness import parse_args, verdict  # noqa: E402
from exporters.cpu_isa import detect_isa  # noqa: E402

SHAPES = {"28x28 gray": (1, 28, 28), "32x32 RGB": (3, 32, 32)}
CLASSES = 10


def host_line(where: Path) -> str:
    isa = detect_isa()
    st = os.statvfs(where)
    fs = "?"
    try:  # the filesystem type of the mount holding ``where`` (Linux)
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, kind, *_ = line.split()
            if str(where.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, fs = mnt, kind
    except OSError:
        pass
    return (f"CPU: {isa.model or isa.arch} ({os.cpu_count()} logical CPUs visible; "
            f"{isa.label}); spool on {fs}, block {st.f_bsize} B, "
            f"{st.f_bavail * st.f_frsize / 2**30:.0f} GiB free")


def batches(rng: np.random.Generator, shape: tuple[int, int, int], n: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rng.random((n, *shape), dtype=np.float32)
    return x, rng.integers(0, CLASSES, n), rng.normal(size=(n, CLASSES)) * 3


def sustained(root: Path, shape: tuple[int, int, int], batch: int, seconds: float,
              quota_mb: float, prefill: bool) -> dict[str, float]:
    """Records for ``seconds``; with ``prefill`` the spool is filled to its quota first, so
    every timed call evicts."""
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    spool = Spool(root, SpoolConfig(quota_mb=quota_mb, min_free_disk_mb=0))
    pool = [batches(rng, shape, batch) for _ in range(16)]
    if prefill:
        fill = batches(rng, shape, 256)
        while not spool.stats().evicted:
            spool.record(*fill[:1], label=fill[1], logits=fill[2])
    lat, stored, t0 = [], 0, time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
        x, y, lg = pool[i % len(pool)]
        t = time.perf_counter()
        stored += spool.record(x if batch > 1 else x[0], label=y if batch > 1 else int(y[0]),
                               logits=lg if batch > 1 else lg[0])
        lat.append(time.perf_counter() - t)
        i += 1
    wall = time.perf_counter() - t0
    st = spool.stats()
    spool.close()
    lat.sort()
    return {"calls_s": i / wall, "samples_s": i * batch / wall, "stored": stored,
            "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
            "evicted": sum(st.evicted.values()), "dropped": sum(st.dropped.values())}


def throughput(work: Path, seconds: float, full_quota_mb: float) -> None:
    print(f"\n1. throughput ({seconds:g} s per row; every returned record fsynced)")
    print(f"{'samples':<11} {'batch':>5} {'spool':<10} {'calls/s':>8} {'samples/s':>10} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'evicted':>8}")
    for label, shape in SHAPES.items():
        for batch in (1, 32):
            for full in (False, True):
                r = sustained(work / "t", shape, batch, seconds,
                              full_quota_mb if full else 4096.0,
                              prefill=full)
                print(f"{label:<11} {batch:>5} {'full' if full else 'empty':<10} "
                      f"{r['calls_s']:8.0f} {r['samples_s']:10.0f} {r['p50_ms']:7.2f} "
                      f"{r['p99_ms']:7.2f} {r['evicted']:8.0f}")


def disk_bound(work: Path, seconds: float, quota_mb: float) -> float:
    """The flood's peak bytes on disk over the quota."""
    print(f"\n2. disk bound: a {seconds:g} s flood of 1/8/64-sample 32x32 RGB records into "
          f"quota_mb={quota_mb:g}")
    root = work / "flood"
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(1)
    spool = Spool(root, SpoolConfig(quota_mb=quota_mb, min_free_disk_mb=0))
    quota = quota_mb * MB
    pool = {n: batches(rng, SHAPES["32x32 RGB"], n) for n in (1, 8, 64)}
    peak, given, stored, t0, calls = 0, 0, 0, time.perf_counter(), 0
    timeline: list[tuple[float, float]] = []
    while time.perf_counter() - t0 < seconds:
        n = int(rng.choice([1, 1, 8, 64]))
        x, y, lg = pool[n]
        stored += spool.record(x, label=y, logits=lg)
        given += n
        calls += 1
        used = sum(p.stat().st_blocks * 512 for p in root.glob("*.seg"))
        peak = max(peak, used)
        if not timeline or time.perf_counter() - t0 >= timeline[-1][0] + seconds / 6:
            timeline.append((time.perf_counter() - t0, used / quota))
    st = spool.stats()
    spool.close()
    print("   t (s)  on disk / quota: " + ", ".join(f"{t:.1f}: {u:.3f}" for t, u in timeline))
    print(f"   {calls} calls, {given} samples given, {stored} stored, {st.samples} kept; peak "
          f"on disk {peak / MB:.2f} MB = {peak / quota:.3f} of the quota "
          f"({'HELD' if peak <= quota else 'EXCEEDED'}); at the end {st.bytes_on_disk / MB:.2f}"
          f" MB, of which {st.evicted_bytes / MB:.2f} MB evicted awaiting compaction")
    return peak / quota


def eviction_cost(work: Path, quota_mb: float, calls: int) -> None:
    print(f"\n3. eviction cost (quota_mb={quota_mb:g}, 28x28 gray)")
    shape = SHAPES["28x28 gray"]
    rng = np.random.default_rng(2)
    for batch, label in ((1, "single"), (32, "batch 32")):
        root = work / f"ev{batch}"
        shutil.rmtree(root, ignore_errors=True)
        spool = Spool(root, SpoolConfig(quota_mb=quota_mb, min_free_disk_mb=0))
        empty: list[float] = []
        full: list[float] = []
        while len(full) < calls:
            x, y, lg = batches(rng, shape, batch)
            t = time.perf_counter()
            spool.record(x if batch > 1 else x[0], label=y if batch > 1 else int(y[0]),
                         logits=lg if batch > 1 else lg[0])
            dt = time.perf_counter() - t
            (full if spool.stats().evicted else empty).append(dt)
        st = spool.stats()
        spool.close()
        t = time.perf_counter()
        reopened = Spool(root, SpoolConfig(quota_mb=quota_mb, min_free_disk_mb=0))
        open_s = time.perf_counter() - t
        t = time.perf_counter()
        info = reopened.snapshot(work / "snap.npz")
        snap_s = time.perf_counter() - t
        reopened.close()
        print(f"   {label:<8}: per call p50 {statistics.median(empty) * 1e3:.2f} ms below the "
              f"quota, {statistics.median(full) * 1e3:.2f} ms at it (p99 "
              f"{sorted(full)[int(len(full) * .99)] * 1e3:.2f} ms); {st.compacted} segments "
              f"rewritten by compaction over {len(full)} evicting calls")
        print(f"             full spool: {st.samples} samples in {st.segments} segments; "
              f"open (index rebuild) {open_s * 1e3:.0f} ms; snapshot of {info.samples} "
              f"samples {snap_s * 1e3:.0f} ms ({info.path.stat().st_size / MB:.1f} MB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per throughput row")
    parser.add_argument("--flood-quota-mb", type=float, default=16.0)
    parser.add_argument("--eviction-quota-mb", type=float, default=8.0)
    parser.add_argument("--full-quota-mb", type=float, default=8.0,
                        help="the full spool's quota in the throughput rows")
    parser.add_argument("--evicting-calls", type=int, default=300,
                        help="eviction cost: timed calls at the quota")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parse_args(parser, {"seconds": 0.2, "flood_quota_mb": 1.0,
                               "eviction_quota_mb": 0.5, "full_quota_mb": 0.5,
                               "evicting_calls": 20}, argv)
    with tempfile.TemporaryDirectory(prefix="spool-bench-", dir=args.dir) as tmp:
        work = Path(tmp)
        print(host_line(work))
        throughput(work, args.seconds, args.full_quota_mb)
        peak = disk_bound(work, 4 * args.seconds, args.flood_quota_mb)
        eviction_cost(work, args.eviction_quota_mb, args.evicting_calls)
    verdict("flood's peak bytes on disk / quota ratio", peak, "<=", 1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
