"""Every model family the project ships, pruned, INT8-quantized and gated on the ONNX Runtime
path, at 8 px (digits' own size) and 32 px: INT8 within one point of the FP32 model it was
made from, with no layer left in float (on this host's recipe, or symmetric int8 where the
fast recipe of an x86 host without VNNI misses), and the whole pipeline (prune +
recovery + INT8) within two points of the model as trained; the TensorRT recipe of the same
model keeps TensorRT's rules, agrees with its unfused graph layer by layer (one quantization
step) and holds the same point.

Each case trains a small model on digits (real Trainer, real data): seconds at 8 px, up to a
minute for the convolutional families at 32 px on one core."""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from exporters.calibration import representative_inputs
from exporters.cpu_isa import detect_isa
from exporters.int8_recipe import TENSORRT_RECIPE, choose_recipe
from exporters.job import CalibrationConfig, ExportJob
from exporters.ort_runner import OrtRunner, ort_session
from exporters.pipeline import run_export
from exporters.qdq_check import check_qdq
from exporters.quantize import prepare_for_quantization, quantize_int8
from exporters.runtime import predict
from hpc_core.models import resolve_factory
from tests.exporters.conftest import _train

# (id, model config, epochs, learning rate) per input size; small widths and few epochs: the
# point is the export, not the last point. vit takes 8 px patches at 32 px (16 tokens, as at
# 8 px with 2 px patches): the attention is the same, at a quarter of the training time.
FAMILIES: dict[int, list[tuple[str, dict[str, Any], int, float]]] = {
    8: [
        ("mlp", {"name": "mlp"}, 6, 0.003),
        ("small_cnn", {"name": "small_cnn", "kwargs": {"width": 16}}, 5, 0.01),
        ("small_cnn-flatten", {"name": "small_cnn", "kwargs": {"width": 16, "pool": "flatten"}},
         5, 0.01),
        ("resnet-batch", {"name": "resnet", "kwargs": {"width": 16, "norm": "batch"}}, 4, 0.01),
        ("resnet-group", {"name": "resnet", "kwargs": {"width": 16, "norm": "group"}}, 4, 0.01),
        ("mobilenet_v2", {"name": "mobilenet_v2", "kwargs": {"width_mult": 0.35}}, 4, 0.01),
        ("vit", {"name": "vit"}, 10, 0.003),
    ],
    32: [
        ("mlp", {"name": "mlp"}, 6, 0.003),
        ("small_cnn", {"name": "small_cnn", "kwargs": {"width": 16}}, 6, 0.01),
        ("resnet-batch", {"name": "resnet", "kwargs": {"width": 16, "norm": "batch"}}, 3, 0.01),
        # GroupNorm at 32 px learns slowly: batches of 16 (4x the steps) and 8 epochs. After 4
        # it stood at 0.77-0.82 (seeds 0-3), still learning fast enough that 20 % pruning and
        # 30 recovery steps alone cost -0.8 to 2.8 points in float, so the 2-point gate read
        # where training had stopped; after 8, 0.91-0.97 and pruning within 0.3 points.
        ("resnet-group", {"name": "resnet", "kwargs": {"width": 8, "norm": "group"}}, 8, 0.003),
        ("mobilenet_v2", {"name": "mobilenet_v2", "kwargs": {"width_mult": 0.35}}, 3, 0.01),
        ("vit", {"name": "vit", "kwargs": {"patch": 8}}, 10, 0.003),
    ],
}
CASES = [pytest.param(model, size, epochs, lr, id=f"{name}-{size}px")
         for size, families in FAMILIES.items() for name, model, epochs, lr in families]
# The whole pipeline against the model as trained: pruning and recovery cost their share.
GATES = {"latency_iters": 3, "latency_warmup": 1, "batch_size": 8, "max_top1_drop_pts": 2.0}
# Fused INT8 against the unfused graph, layer by layer: a correct fused kernel and the unfused
# float ops disagree only where a value lies within their float32 difference of a rounding
# boundary (the bias, rounded to the accumulator's step, is most of it): at most 1.1 % of any
# tensor over the zoo, in mobilenet_v2's depthwise layers on 1x1 maps. A biased rounding
# (truncation) would put about half of every tensor a step off.
OFF_BY_ONE_SHARE = 0.1


@pytest.mark.slow
@pytest.mark.parametrize(("model", "size", "epochs", "lr"), CASES)
def test_family_prunes_and_exports_int8_within_a_point(
    model: dict[str, Any], size: int, epochs: int, lr: float, tmp_path: Path
) -> None:
    group_norm = model["name"] == "resnet" and model["kwargs"]["norm"] == "group"
    slow_learner = group_norm and size == 32
    # The convolutional families train in NHWC order (training.channels_last), as a user on a
    # CPU would: one training step of 64 at one thread took 0.52x the CPU of NCHW for
    # mobilenet_v2, 0.71-0.75x for resnet with batch norm, 0.77-0.80x for small_cnn; resnet
    # with GroupNorm gained nothing (1.03x) and stays NCHW. The export reads the checkpoint,
    # written in the usual order either way.
    nhwc = model["name"] in ("small_cnn", "resnet", "mobilenet_v2") and not group_norm
    trained = _train(tmp_path / "train", model, None if size == 8 else size, epochs, lr=lr,
                     batch=16 if slow_learner else 64, channels_last=nhwc)
    assert trained.val_acc > 0.85, f"{model['name']} did not train"
    # No layer may be excluded and no float fallback: INT8 on the host's recipe, or, where that
    # is the fast u8s8 one, symmetric int8 (exact on every host) after it.
    report = run_export(ExportJob(
        checkpoint=trained.checkpoint, out_dir=tmp_path / "out", precision="int8",
        # A tenth of the training LR: 20 % magnitude pruning needs a touch-up, not a re-train.
        prune="unstructured:0.2", recovery={"steps": 30, "lr": lr / 10},  # type: ignore[arg-type]
        fallback={"max_excluded_layers": 0, "fp16": False, "fp32": False}, gates=GATES,
    ))
    assert report.winner in ("int8", "int8-s8s8"), report.fallback_reason
    attempt = next(a for a in report.attempts if a.passed)
    assert attempt.excluded == []
    assert report.int8 is not None
    assert report.int8["recipe"] == choose_recipe("onnxruntime", detect_isa()).name
    assert attempt.qdq_violations == []
    x, y = trained.held_out()
    fp32 = tmp_path / "out" / "model.fp32.onnx"  # the pruned, recovered model, in float
    pruned = _top1(predict(OrtRunner(fp32), x), y)
    int8 = _top1(predict(OrtRunner(tmp_path / "out" / "model.onnx"), x), y)
    assert (pruned - int8) * 100 <= 1.0, f"INT8 {int8:.4f} vs its FP32 {pruned:.4f}"
    if model["name"] == "vit":
        # Attention runs in INT8 too: Q.K^T and softmax.V take two dequantized activations.
        attention = _activation_matmuls(tmp_path / "out" / "model.onnx")
        depth = model.get("kwargs", {}).get(
            "depth", inspect.signature(resolve_factory("vit")).parameters["depth"].default)
        assert len(attention) == 2 * depth and all(ins == ["DequantizeLinear"] * 2
                                               for ins in attention.values()), attention

    # The TensorRT recipe of the same file: TensorRT's structural rules, the fused kernels of
    # this host agree with the unfused graph layer by layer, and it holds the same point.
    prepared = prepare_for_quantization(fp32, tmp_path / "prep.onnx")
    train, _ = trained.splits()
    calib = representative_inputs(train, 512)
    trt = quantize_int8(prepared, tmp_path / "trt.onnx", calib_inputs=calib, input_name="input",
                        cfg=CalibrationConfig(), recipe=TENSORRT_RECIPE)
    assert check_qdq(trt.path) == []
    # Each activation tensor of the fused session, computed from exactly the integer inputs
    # the unfused graph gave its layer: the integer kernel sums the same int8 products exactly
    # and rounds once (bias and scales in float32), the unfused graph sums them in float32 and
    # rounds once. Two roundings to nearest of values that differ by a small fraction of a step
    # differ by at most one step, and only for values that close to a rounding boundary. A
    # saturating pair sum, a wrong scale or zero point, a skipped quantization move elements by
    # many steps; a biased rounding (truncation) moves about half of them by one.
    # End to end these one-step differences compound through the layers (8 logit steps in one
    # mobilenet_v2 at 8 px, 52 convolutions deep), so a share of agreeing top-1s counts the
    # held-out samples near a tie in the particular trained model, not what the kernels do:
    # that mobilenet_v2 fell under 99 % for 3 of 6 training seeds on one host, kernels exact.
    layers = _fused_layer_by_layer(trt.path, x, tmp_path / "layers")
    assert layers.file_kernels and all(
        layers.kernels[k] >= n for k, n in layers.file_kernels.items()
    ), f"not every integer kernel is checked: {layers.kernels} vs {layers.file_kernels}"
    assert max(layers.steps.values()) <= 1, {k: v for k, v in layers.steps.items() if v > 1}
    assert max(layers.off.values()) <= OFF_BY_ONE_SHARE, {
        k: round(v, 4) for k, v in layers.off.items() if v > OFF_BY_ONE_SHARE}
    fused = predict(OrtRunner(trt.path), x)
    assert (pruned - _top1(fused, y)) * 100 <= 1.0


@dataclass
class _LayerCheck:
    steps: dict[str, int]
    """Per activation QuantizeLinear output: the largest |fused - unfused|, in its steps."""
    off: dict[str, float]
    """Per activation QuantizeLinear output: the share of its elements that differ at all."""
    kernels: Counter[str]
    """The integer operators of the fused session the layers were checked in."""
    file_kernels: Counter[str]
    """The integer operators of the fused session on the file itself."""


def _integer_kernels(path: Path, saved: Path) -> Counter[str]:
    """The integer operators in the graph the project's fused session runs for ``path``."""
    opts = ort_session(path).get_session_options()
    opts.optimized_model_filepath = str(saved)
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(saved)).graph.node
                   if n.op_type.startswith(("QLinear", "QGemm", "MatMulInteger", "ConvInteger")))


def _fused_layer_by_layer(path: Path, x: np.ndarray, work: Path, batch: int = 64) -> _LayerCheck:
    """Every activation QuantizeLinear of the Q/DQ file ``path`` computed by the project's fused
    session from the unfused graph's values, against the unfused graph (every op in float).

    The file is cut at each activation Q: the Q keeps its producer and is read through a
    DequantizeLinear of its own; its consumers read a twin of it fed with the float the
    unfused graph quantized there (the twin gives back exactly the unfused integers), so
    every layer fuses as in the file and starts from the unfused graph's inputs."""
    work.mkdir(parents=True, exist_ok=True)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    graph = model.graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    infos = {v.name: v for v in (*graph.value_info, *graph.input, *graph.output)}
    (x_name,) = (i.name for i in graph.input)
    qs = [n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in consts]
    quantized = {q.output[0] for q in qs}

    def info(name: str, as_name: str) -> onnx.ValueInfoProto:
        v = onnx.ValueInfoProto()
        v.CopyFrom(infos[name])
        v.name = as_name
        return v

    unfused_model = onnx.ModelProto()
    unfused_model.CopyFrom(model)
    shown = {o.name for o in graph.output} | {x_name}
    exposed = dict.fromkeys(n for q in qs for n in (q.input[0], q.output[0]) if n not in shown)
    unfused_model.graph.output.extend(info(n, n) for n in exposed)

    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    nodes = []
    for n in graph.node:
        node = onnx.NodeProto()
        node.CopyFrom(n)
        if n.op_type == "QuantizeLinear" and n.output[0] in quantized:
            twin = onnx.NodeProto()
            twin.CopyFrom(n)
            twin.name, twin.input[0], twin.output[0] = (
                f"{n.name}@unfused", f"{n.input[0]}@unfused", f"{n.output[0]}@unfused")
            nodes += [node, twin, helper.make_node(
                "DequantizeLinear", [n.output[0], *n.input[1:]], [f"{n.output[0]}@fused"],
                name=f"{n.name}@fused")]
        else:
            node.input[:] = [f"{i}@unfused" if i in quantized else i for i in node.input]
            nodes.append(node)
    del cut.graph.node[:]
    cut.graph.node.extend(nodes)
    cut.graph.input.extend(info(n, f"{n}@unfused") for n in dict.fromkeys(q.input[0] for q in qs))
    del cut.graph.output[:]
    cut.graph.output.extend(info(q.input[0], f"{q.output[0]}@fused") for q in qs)
    onnx.save(unfused_model, str(work / "unfused.onnx"))
    onnx.save(cut, str(work / "cut.onnx"))

    unfused = ort_session(work / "unfused.onnx", optimize=False)
    fused = ort_session(work / "cut.onnx")
    unfused_names = [o.name for o in unfused.get_outputs()]
    fused_inputs = [i.name for i in fused.get_inputs()]
    steps = dict.fromkeys(quantized, 0)
    differ, size = Counter[str](), Counter[str]()
    for i in range(0, len(x), batch):
        values = dict(zip(unfused_names, unfused.run(None, {x_name: x[i : i + batch]}),
                          strict=True))
        values[x_name] = x[i : i + batch]
        got = fused.run([f"{q.output[0]}@fused" for q in qs],
                        {n: values[n.removesuffix("@unfused")] for n in fused_inputs})
        for q, value in zip(qs, got, strict=True):
            scale, zero = consts[q.input[1]], consts[q.input[2]].astype(np.int32)
            want = values[q.output[0]].astype(np.int32) - zero
            d = np.abs(np.rint(value / scale).astype(np.int32) - want)
            steps[q.output[0]] = max(steps[q.output[0]], int(d.max()))
            differ[q.output[0]] += int(np.count_nonzero(d))
            size[q.output[0]] += d.size
    return _LayerCheck(
        steps=steps, off={k: differ[k] / size[k] for k in size},
        kernels=_integer_kernels(work / "cut.onnx", work / "cut.optimized.onnx"),
        file_kernels=_integer_kernels(path, work / "optimized.onnx"),
    )


def _activation_matmuls(path: Path) -> dict[str, list[str]]:
    """MatMuls with no weight (both inputs computed): what feeds each of them."""
    graph = onnx.load(str(path)).graph
    made_by = {o: n for n in graph.node for o in n.output}
    weights = {i.name for i in graph.initializer}

    def source(name: str) -> str:  # the DQ of a weight leads back to an initializer
        n = made_by.get(name)
        return "weight" if n is None or (n.op_type == "DequantizeLinear"
                                         and n.input[0] in weights) else n.op_type

    out = {}
    for n in graph.node:
        if n.op_type == "MatMul":
            ins = [source(i) for i in n.input]
            if "weight" not in ins:
                out[n.name] = ins
    return out


def _top1(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(1) == labels).mean())
