"""What ONNX Runtime's spinning threads cost a paced server: CPU per request and latency of
one session serving batch-1 requests at a camera's rate, its intra-op threads spinning
between requests (ONNX Runtime's default, what ``agentctl serve --spin`` keeps) against
sleeping (``session.intra_op.allow_spinning=0``, the serving runtime's default since this
measurement: ``exporters.ort_runner.NO_SPINNING``).

The model: a small convolutional net written with ``onnx.helper`` (four 3x3 convolutions of
16 channels on a 1x3xSIZExSIZE image, pooled, a linear layer to 10 classes), fixed random
weights; the sessions are ``exporters.ort_runner.ort_session`` at ``--threads`` (0: all
cores). Each round serves ``--requests`` requests at ``--rate`` per second with both
settings, the order alternating between rounds; the CPU is the process's own (all its
threads), user + system.

    python benchmarks/ort_spin.py [--rate 20] [--requests 200] [--rounds 2] [--threads 0]
        [--size 64]
    python benchmarks/ort_spin.py --quick

Target: sleeping threads take at most half the CPU per request that spinning ones do.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

from benchmarks.harness import cpu_line, parse_args, verdict  # noqa: E402
from exporters.ort_runner import ort_session  # noqa: E402

TARGET_RATIO = 0.5
"""CPU per request, threads sleeping / threads spinning."""
CHANNELS = 16


def small_convnet(path: Path, size: int) -> None:
    """Four conv + relu layers, global average pool, a linear layer: a camera model in
    miniature, enough operators that a run wakes the thread pool several times."""
    rng = np.random.default_rng(0)
    nodes, inits, prev, cin = [], [], "image", 3
    for i in range(4):
        w = rng.normal(0, 0.2, (CHANNELS, cin, 3, 3)).astype(np.float32)
        b = np.zeros(CHANNELS, np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"],
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        prev, cin = f"r{i}", CHANNELS
    fc = rng.normal(0, 0.2, (CHANNELS, 10)).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc"),
              numpy_helper.from_array(np.zeros(10, np.float32), "fcb")]
    nodes += [helper.make_node("GlobalAveragePool", [prev], ["pool"]),
              helper.make_node("Flatten", ["pool"], ["flat"]),
              helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"])]
    graph = helper.make_graph(
        nodes, "small_convnet",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def serve(path: Path, *, spin: bool, threads: int, rate: float, requests: int,
          size: int) -> tuple[float, list[float]]:
    """(CPU seconds, latencies in ms) of ``requests`` batch-1 runs, one every 1/rate s."""
    session = ort_session(path, threads=threads, spin=spin)
    x = np.random.default_rng(1).random((1, 3, size, size), dtype=np.float32)
    for _ in range(10):  # warm-up: the first runs allocate
        session.run(None, {"image": x})
    period, lat = 1.0 / rate, []
    c0, next_t = time.process_time(), time.perf_counter()
    for _ in range(requests):
        t = time.perf_counter()
        session.run(None, {"image": x})
        lat.append((time.perf_counter() - t) * 1e3)
        next_t += period
        time.sleep(max(0.0, next_t - time.perf_counter()))
    used = time.process_time() - c0  # every thread of this process
    del session
    return used, lat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    ap.add_argument("--requests", type=int, default=200, help="requests per setting per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the order alternating")
    ap.add_argument("--threads", type=int, default=0,
                    help="ONNX Runtime intra-op threads (default 0: all cores)")
    ap.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    args = parse_args(ap, quick={"requests": 20, "rounds": 1, "rate": 50.0, "size": 32},
                      argv=argv)
    print(f"{cpu_line()}; load average {os.getloadavg()[0]:.2f}")
    print(f"{args.requests} batch-1 requests at {args.rate:g}/s per setting per round, "
          f"{args.rounds} rounds, threads={args.threads}, image {args.size}x{args.size}")
    found: dict[bool, tuple[float, list[float]]] = {True: (0.0, []), False: (0.0, [])}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "small_convnet.onnx"
        small_convnet(path, args.size)
        for r in range(args.rounds):
            for spin in ((True, False) if r % 2 == 0 else (False, True)):
                used, lat = serve(path, spin=spin, threads=args.threads, rate=args.rate,
                                  requests=args.requests, size=args.size)
                found[spin] = (found[spin][0] + used, found[spin][1] + lat)
    n = args.requests * args.rounds
    print(f"{'threads':<10}{'CPU s':>8}{'CPU ms/request':>16}{'p50 ms':>9}{'p99 ms':>9}")
    for spin, label in ((True, "spinning"), (False, "sleeping")):
        used, lat = found[spin]
        print(f"{label:<10}{used:>8.2f}{used / n * 1e3:>16.2f}"
              f"{np.percentile(lat, 50):>9.2f}{np.percentile(lat, 99):>9.2f}")
    ratio = found[False][0] / max(found[True][0], 1e-9)
    verdict("sleeping / spinning ONNX Runtime threads CPU per request ratio", ratio, "<=",
            TARGET_RATIO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
