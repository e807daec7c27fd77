"""The ``int8-qat`` step: a detector whose post-training INT8 misses the mAP@0.5 gate is
fine-tuned under fake quantization and quantized again, and that one meets it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from exporters.qat import QMAX, FakeQuantConv, fold_batchnorm, insert_fake_quant
from tests.exporters.conftest import TrainedDetector
from tests.exporters.test_detection_export import make_fragile, run_detector_export


def test_qat_recovers_a_post_training_int8_miss(detector: TrainedDetector,
                                                 tmp_path: Path) -> None:
    # A milder fragile layer than the sensitivity test's: its INT8 input and weights cost
    # mAP@0.5 points, which a short fine-tune under fake quantization wins back; leaving
    # layers in float is switched off so that QAT is the step that has to meet the gate.
    ckpt, _ = make_fragile(detector, tmp_path, scale=400.0)
    report = run_detector_export(
        detector, tmp_path / "out", ckpt, keep_intermediates=True,
        gates={"batch_size": 8, "latency_iters": 2, "latency_warmup": 0,
               "max_top1_drop_pts": None, "max_map50_drop_pts": 5.0},
        fallback={"max_excluded_layers": 0, "qat": True, "fp16": False, "fp32": False},
        qat={"steps": 40, "lr": 5e-5})
    ptq, qat = report.attempts
    assert (ptq.step, qat.step) == ("int8", "int8-qat")
    assert not ptq.passed and ptq.measurement.map50_drop_pts > 5.0, ptq.failures
    assert qat.passed and report.winner == "int8-qat", report.fallback_reason
    assert qat.measurement.map50 > ptq.measurement.map50
    assert qat.qdq_violations == [] and qat.recipe == "s8s8-symmetric"
    assert report.qat["steps"] == 40 and report.qat["fake_quant_convs"] > 50
    assert report.qat["folded_batchnorms"] > 50
    assert "int8-qat won" in report.fallback
    # The INT8 weights of the installed file are the fine-tuned weights on the grid the
    # fine-tune trained against (per channel, max|w| / 127), node for node.
    work = tmp_path / "out" / "work"
    fp32 = {i.name: numpy_helper.to_array(i)
            for i in onnx.load(str(work / "qat.prep.onnx")).graph.initializer}
    q = onnx.load(str(work / "int8-qat.core.onnx")).graph
    inits = {i.name: numpy_helper.to_array(i) for i in q.initializer}
    checked = 0
    for dq in (n for n in q.node if n.op_type == "DequantizeLinear" and n.input[0] in inits):
        w_q, scale = inits[dq.input[0]], inits[dq.input[1]]
        name = dq.input[0].removesuffix("_quantized")
        if w_q.ndim != 4 or name not in fp32:
            continue
        w = torch.from_numpy(fp32[name].copy())
        s = (w.abs().amax(dim=(1, 2, 3)) / QMAX).clamp(min=1e-8)
        np.testing.assert_allclose(scale, s.numpy(), rtol=1e-6)
        fq = torch.fake_quantize_per_channel_affine(
            w, s, torch.zeros(len(s), dtype=torch.int32), 0, -QMAX, QMAX)
        np.testing.assert_allclose(w_q * scale.reshape(-1, 1, 1, 1), fq.numpy(), atol=1e-7)
        checked += 1
    assert checked > 50
    # ... and each convolution's input takes the range the fine-tune ended with, not a
    # calibrated one: its Q/DQ scale is that range / 127.
    import json

    from exporters.pipeline import conv_input_ranges

    ranges = json.loads((work / "qat" / "qat.json").read_text())["activation_ranges"]
    by_tensor = conv_input_ranges(work / "qat.prep.onnx", ranges)
    assert len(by_tensor) == report.qat["activation_ranges_set"] > 50
    quant = {n.input[0]: inits[n.input[1]] for n in q.node if n.op_type == "QuantizeLinear"}
    shared = [t for t in by_tensor if t in quant]
    assert len(shared) > 50
    for t in shared:
        assert float(quant[t]) == pytest.approx(by_tensor[t] / QMAX, rel=1e-6)


def test_fake_quant_keeps_the_float_function_of_folded_batchnorm(
        detector: TrainedDetector) -> None:
    model = detector.model()
    x = torch.rand(2, 3, 64, 64)
    from exporters.detection.core import DetectorCore

    with torch.no_grad():
        ref = DetectorCore(model)(x)
        assert fold_batchnorm(model) > 50
        folded = DetectorCore(model)(x)
        n = insert_fake_quant(model)
        model.train()
        DetectorCore(model)(x)  # one batch sets the activation ranges
        model.eval()
        fake = DetectorCore(model)(x)
    np.testing.assert_allclose(folded.numpy(), ref.numpy(), atol=1e-3)
    assert n == sum(isinstance(m, FakeQuantConv) for m in model.modules())
    err = (fake - ref).abs().mean() / ref.abs().mean()
    assert 0 < err < 0.1  # INT8 rounding: some error, not a broken network
