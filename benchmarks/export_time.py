"""The dynamo exporter's CPU per export: a model's in-place activations traced out of place
(``exporters.onnx_export.activations_out_of_place``, what every export now does) beside the
model as it is.

torch.export functionalizes an in-place Hardtanh (ReLU6), Hardswish or Hardsigmoid (the
activations of MobileNetV2 and V3) by tracing its reference implementation down to prims,
each of which checks its shapes on the symbolic batch through sympy. Out of place, the same
ops are traced as themselves. Both exports of each model are compared node by node
(op, attributes, wiring, weights; only the generated value names may differ): the verdict
counts only if every pair is the same graph.

Models, each exported with a dynamic batch as the export step does: the demo's detector core
(SSDlite on a half-width MobileNetV3-Large at 160 px, 6 classes: normalisation, backbone and
head), mobilenet_v2 (width 0.35) and resnet (width 16, BatchNorm) at 32 px. One process, one
warm-up export first, then ``--rounds`` rounds in which each model is exported both ways, the
order alternating. Targets: the detector's and mobilenet_v2's exports cost at most 0.8x the
baseline's CPU; resnet's (in-place ReLU only, left as it is) at most 1.05x.

    python benchmarks/export_time.py [--rounds 3] [--models ssdlite,mobilenet_v2,resnet]
    python benchmarks/export_time.py --quick    # one round of resnet at 8 px: it runs
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

import onnx  # noqa: E402
import torch  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

import exporters.onnx_export as onnx_export  # noqa: E402
from benchmarks.harness import cpu_line, fmt, parse_args, verdict  # noqa: E402
from exporters.job import OnnxExportConfig  # noqa: E402
from hpc_core.models import build_model  # noqa: E402

TARGET = 0.8
AS_IT_IS = onnx_export.activations_out_of_place


@contextlib.contextmanager
def _as_it_is(model: nn.Module, example: torch.Tensor) -> Iterator[None]:
    """The baseline: the model traced with its in-place modules as they are."""
    yield


def _ssdlite(size: int) -> tuple[nn.Module, tuple[int, ...]]:
    from exporters.detection.core import DetectorCore

    ssd = build_model("torchvision/ssdlite320_mobilenet_v3_large", num_classes=6,
                      in_channels=3, image_size=size, width_mult=0.5, bn_momentum=0.1)
    return DetectorCore(ssd.eval()), (3, size, size)


def _family(name: str, **kwargs: Any) -> Callable[[int], tuple[nn.Module, tuple[int, ...]]]:
    def make(size: int) -> tuple[nn.Module, tuple[int, ...]]:
        return build_model(name, num_classes=10, in_channels=1, image_size=size,
                           **kwargs), (1, size, size)

    return make


MODELS: dict[str, tuple[Callable[[int], tuple[nn.Module, tuple[int, ...]]], int, float]] = {
    "ssdlite": (_ssdlite, 160, TARGET),
    "mobilenet_v2": (_family("mobilenet_v2", width_mult=0.35), 32, TARGET),
    # In-place ReLU only, which is left as it is: the export must cost what it did.
    "resnet": (_family("resnet", width=16, norm="batch"), 32, 1.05),
}
"""name -> (builder taking the input size, input size, target ratio)"""


def graph_of(path: Path) -> list[tuple[Any, ...]]:
    """The graph with the exporter's generated value names replaced by their order of first
    appearance: two exports of one model compare equal when only those names differ."""
    g = onnx.load(str(path)).graph
    fixed = {v.name for v in (*g.input, *g.output)}
    weights = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    names: dict[str, str] = {}

    def name(v: str) -> Any:
        if v in fixed or not v:
            return v
        if v in weights:
            return ("weight", weights[v].shape, weights[v].tobytes())
        return names.setdefault(v, f"v{len(names)}")

    return [(n.op_type, n.domain, [name(i) for i in n.input], [name(o) for o in n.output],
             sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in n.attribute))
            for n in g.node]


def export_cpu(model: nn.Module, shape: tuple[int, ...], path: Path, baseline: bool) -> float:
    onnx_export.activations_out_of_place = _as_it_is if baseline else AS_IT_IS
    try:
        t0 = time.process_time()
        onnx_export.export_onnx(model, path, shape, OnnxExportConfig(simplify="off"))
        return time.process_time() - t0
    finally:
        onnx_export.activations_out_of_place = AS_IT_IS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="exports of each model, each way")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, the first is the headline: {', '.join(MODELS)}")
    ap.add_argument("--size", type=int, help="input size in px of every model (default: "
                    "each model's own)")
    a = parse_args(ap, {"rounds": 1, "models": "resnet", "size": 8})
    models = a.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown or a.rounds < 1:
        ap.error(f"--models: unknown {unknown}" if unknown else "--rounds: at least 1")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(f"host: {cpu_line()}")
    print(f"torch {torch.__version__}, onnx {onnx.__version__}; command: python "
          f"benchmarks/export_time.py --rounds {a.rounds} --models {a.models}"
          f"{' --quick' if a.quick else ''}\n")
    ratios: dict[str, float] = {}
    same = True
    with tempfile.TemporaryDirectory(prefix="export-time-") as tmp:
        work = Path(tmp)
        warm, warm_shape = _family("small_cnn")(8)
        export_cpu(warm, warm_shape, work / "warm.onnx", baseline=False)  # imports, tables
        print(f"{'model':<14} {'size':>5} {'as it is, CPU s':>16} {'out of place':>13} "
              f"{'ratio':>7}  same graph")
        for name in models:
            build, size, _ = MODELS[name]
            model, shape = build(a.size or size)
            cpu: dict[bool, list[float]] = {True: [], False: []}
            for r in range(a.rounds):
                for baseline in ((True, False) if r % 2 == 0 else (False, True)):
                    path = work / f"{name}.{'base' if baseline else 'new'}.onnx"
                    cpu[baseline].append(export_cpu(model, shape, path, baseline))
            equal = graph_of(work / f"{name}.base.onnx") == graph_of(work / f"{name}.new.onnx")
            same &= equal
            before, after = statistics.median(cpu[True]), statistics.median(cpu[False])
            ratios[name] = after / before
            print(f"{name:<14} {shape[-1]:>5} {fmt(before):>16} {fmt(after):>13} "
                  f"{fmt(ratios[name]):>7}  {'yes' if equal else 'NO'}")
    head = models[0]
    verdict(f"{head} export CPU, activations out of place / as they are (median) ratio",
            ratios[head], "<=", MODELS[head][2],
            also=[(f"{m} <= {MODELS[m][2]}x", r <= MODELS[m][2]) for m, r in ratios.items()
                  if m != head] + [("every pair the same graph", same)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
