"""Every model family the project ships, pruned, INT8-quantized and gated on the ONNX Runtime
path, at 8 px (digits' own size) and 32 px: INT8 within one point of the FP32 model it was
made from, with no layer left in float (on this host's recipe, or symmetric int8 where the
fast recipe of an x86 host without VNNI misses), and the whole pipeline (prune +
recovery + INT8) within two points of the model as trained; the TensorRT recipe of the same
model keeps TensorRT's rules, agrees with its unfused graph and holds the same point.

Each case trains a small model on digits (real Trainer, real data): seconds at 8 px, up to a
minute for the convolutional families at 32 px on one core."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from exporters.calibration import representative_inputs
from exporters.cpu_isa import detect_isa
from exporters.int8_recipe import TENSORRT_RECIPE, choose_recipe
from exporters.job import CalibrationConfig, ExportJob
from exporters.ort_runner import OrtRunner
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
        ("small_cnn", {"name": "small_cnn", "kwargs": {"width": 32}}, 6, 0.003),
        ("resnet-batch", {"name": "resnet", "kwargs": {"width": 16, "norm": "batch"}}, 3, 0.01),
        # GroupNorm at 32 px learns slowly: batches of 16 (4x the steps), a lower bar below.
        ("resnet-group", {"name": "resnet", "kwargs": {"width": 8, "norm": "group"}}, 4, 0.003),
        ("mobilenet_v2", {"name": "mobilenet_v2", "kwargs": {"width_mult": 0.35}}, 3, 0.01),
        ("vit", {"name": "vit", "kwargs": {"patch": 8}}, 10, 0.003),
    ],
}
CASES = [pytest.param(model, size, epochs, lr, id=f"{name}-{size}px")
         for size, families in FAMILIES.items() for name, model, epochs, lr in families]
# The whole pipeline against the model as trained: pruning and recovery cost their share.
GATES = {"latency_iters": 3, "latency_warmup": 1, "batch_size": 8, "max_top1_drop_pts": 2.0}


@pytest.mark.slow
@pytest.mark.parametrize(("model", "size", "epochs", "lr"), CASES)
def test_family_prunes_and_exports_int8_within_a_point(
    model: dict[str, Any], size: int, epochs: int, lr: float, tmp_path: Path
) -> None:
    slow_learner = model["name"] == "resnet" and model["kwargs"]["norm"] == "group" and size == 32
    trained = _train(tmp_path / "train", model, None if size == 8 else size, epochs, lr=lr,
                     batch=16 if slow_learner else 64)
    assert trained.val_acc > (0.7 if slow_learner else 0.85), f"{model['name']} did not train"
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
    # this host agree with the unfused graph, and it holds the same point.
    prepared = prepare_for_quantization(fp32, tmp_path / "prep.onnx")
    train, _ = trained.splits()
    calib = representative_inputs(train, 512)
    trt = quantize_int8(prepared, tmp_path / "trt.onnx", calib_inputs=calib, input_name="input",
                        cfg=CalibrationConfig(), recipe=TENSORRT_RECIPE)
    assert check_qdq(trt.path) == []
    fused = predict(OrtRunner(trt.path), x)
    unfused = predict(OrtRunner(trt.path, optimize=False), x)
    assert np.mean(fused.argmax(1) == unfused.argmax(1)) > 0.99
    assert (pruned - _top1(fused, y)) * 100 <= 1.0


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
