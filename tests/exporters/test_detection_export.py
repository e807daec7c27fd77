"""A detector's export: NMS in the graph, equal to torchvision's own post-processing; the
EfficientNMS_TRT form for TensorRT; the gates by mAP; the fragile layer kept in float."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from exporters.detection.form import CORE_FILE, TAIL_FILE, DetectionForm
from exporters.detection.outputs import (
    BOXES,
    CLASSES,
    NUM_DETECTIONS,
    OUTPUT_DTYPES,
    OUTPUT_NAMES,
    SCORES,
    output_shapes,
    pack_detections,
)
from exporters.detection.tail import TRT_DOMAIN, TRT_PLUGIN, TailSpec, attach
from exporters.job import ExportJob, OnnxExportConfig, unexportable
from exporters.ort_runner import ort_session
from exporters.qdq_check import check_qdq
from tests.exporters.conftest import DETECTOR_SIZE, TrainedDetector

SHAPE = (3, DETECTOR_SIZE, DETECTOR_SIZE)


def images(det: TrainedDetector, n: int = 12) -> np.ndarray:
    from hpc_core.tasks.detection.sources import build_detection_datasets

    train, val, _ = build_detection_datasets(det.config.data)
    items = [val[i][0] for i in range(len(val))] + [train[i][0] for i in range(n)]
    return torch.stack(items).numpy()


def ties_in_order(scores: np.ndarray, classes: np.ndarray, boxes: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows by decreasing score, equal scores (to 1e-6) ordered by class then box."""
    key = np.lexsort((*np.round(boxes.T[::-1], 2), classes, -np.round(scores, 6)))
    return scores[key], classes[key], boxes[key]


def test_nms_in_the_graph_equals_torchvision_post_processing(detector: TrainedDetector,
                                                              tmp_path: Path) -> None:
    model = detector.model()
    form = DetectionForm()
    exported = form.export(model, tmp_path / "model.onnx", SHAPE,
                           OnnxExportConfig(exporter="torchscript", opset=17), tmp_path)
    assert exported.core == tmp_path / CORE_FILE and exported.tail == tmp_path / TAIL_FILE
    x = images(detector)
    session = ort_session(exported.onnx.path)
    assert [o.name for o in session.get_outputs()] == list(OUTPUT_NAMES)
    out = dict(zip(OUTPUT_NAMES, session.run(list(OUTPUT_NAMES), {"input": x}), strict=True))
    k = TailSpec.load(exported.tail).k
    assert k == model.detections_per_img
    for name, shape in output_shapes(k).items():
        assert out[name].dtype == OUTPUT_DTYPES[name]
        assert out[name].shape == (len(x), *shape[1:])
    with torch.no_grad():
        ref = model(list(torch.from_numpy(x)))  # torchvision's decoding and NMS, eval mode
    assert sum(len(r["scores"]) for r in ref) > 3 * len(x)  # the model does detect
    ties = 0
    for i, r in enumerate(ref):
        n = len(r["scores"])
        assert out[NUM_DETECTIONS][i, 0] == n
        np.testing.assert_allclose(out[SCORES][i, :n], r["scores"].numpy(), atol=1e-5)
        # Equal scores (anchors of a symmetric pattern) may come in either order: within a
        # run of equal scores, rows are compared in one canonical order.
        got = ties_in_order(out[SCORES][i, :n], out[CLASSES][i, :n], out[BOXES][i, :n])
        want = ties_in_order(r["scores"].numpy(), r["labels"].numpy() - 1, r["boxes"].numpy())
        ties += int((np.diff(out[SCORES][i, :n]) == 0).sum())
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_allclose(got[2], want[2], atol=1e-3)
        # padding after the detections
        assert (out[SCORES][i, n:] == 0).all() and (out[CLASSES][i, n:] == -1).all()
    # the packed form the gates score is the same detections
    packed = pack_detections([{k_: v.numpy() for k_, v in r.items()} for r in ref], k, 1)
    assert packed.shape == (len(x), k, 6)


def test_the_tensorrt_recipe_ends_in_efficient_nms_and_passes_the_qdq_check(
        detector: TrainedDetector, tmp_path: Path) -> None:
    from exporters.calibration import representative_inputs
    from exporters.int8_recipe import Int8Recipe
    from exporters.job import CalibrationConfig
    from exporters.quantize import prepare_for_quantization, quantize_int8

    model = detector.model()
    exported = DetectionForm().export(model, tmp_path / "model.onnx", SHAPE,
                                      OnnxExportConfig(), tmp_path)
    assert exported.core is not None and exported.tail is not None
    prep = prepare_for_quantization(exported.core, tmp_path / "prep.onnx")
    from hpc_core.tasks.detection.sources import build_detection_datasets

    train, _, _ = build_detection_datasets(detector.config.data)
    calib = representative_inputs(train, 16)
    core = quantize_int8(prep, tmp_path / "core.int8.onnx", calib_inputs=calib,
                         input_name="input", cfg=CalibrationConfig(batch_size=8),
                         recipe=Int8Recipe("s8s8-symmetric", "TensorRT")).path
    spec = TailSpec.load(exported.tail)
    trt = attach(core, spec, tmp_path / "model.trt.onnx", nms="efficient_nms_trt")
    assert check_qdq(trt, activations_signed=True) == []
    g = onnx.load(str(trt)).graph
    plugin = [n for n in g.node if n.op_type == TRT_PLUGIN]
    assert len(plugin) == 1 and plugin[0].domain == TRT_DOMAIN
    assert not [n for n in g.node if n.op_type == "NonMaxSuppression"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in plugin[0].attribute}
    assert attrs["max_output_boxes"] == spec.k and attrs["background_class"] == -1
    assert attrs["score_activation"] == 0 and attrs["box_coding"] == 0
    assert attrs["iou_threshold"] == pytest.approx(spec.nms_thresh)
    assert attrs["score_threshold"] == pytest.approx(spec.score_thresh)
    assert list(plugin[0].output) == [o.name for o in g.output] == list(OUTPUT_NAMES)
    # the plugin takes the decoded boxes [N, A, 4] and the foreground scores [N, A, C-1]
    shapes = onnx.shape_inference.infer_shapes(onnx.load(str(trt)), strict_mode=False).graph
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in shapes.value_info}
    a = len(spec.anchors)
    assert dims[plugin[0].input[0]][1:] == [a, 4]
    assert dims[plugin[0].input[1]][1:] == [a, spec.num_classes - 1]
    # decoding and NMS stay in float: no Q/DQ node after the head
    tail_nodes = [n for n in g.node if n.name.startswith("tail/")]
    assert tail_nodes and not [n for n in tail_nodes if "Quantize" in n.op_type]


def test_only_torchvision_ssd_detectors_are_exported() -> None:
    assert unexportable("detection", "torchvision/ssdlite320_mobilenet_v3_large") is None
    why = unexportable("detection", "torchvision/fcos_resnet18_fpn")
    assert why is not None and "no ONNX export yet" in why and "steps.export: false" in why
    assert unexportable("detection") is None  # a factory's model is checked when loaded


def run_detector_export(det: TrainedDetector, out: Path, checkpoint: Path | None = None,
                        **over: object) -> object:
    from exporters.pipeline import run_export

    job = ExportJob.model_validate({
        "checkpoint": str(checkpoint or det.checkpoint), "out_dir": str(out),
        "precision": "int8", "data": det.data(),
        "calibration": {"samples": 16, "batch_size": 8},
        "gates": {"batch_size": 8, "latency_iters": 2, "latency_warmup": 0,
                  "max_top1_drop_pts": 5.0, "max_map50_drop_pts": 5.0},
        "fallback": {"max_excluded_layers": 1, "sensitivity_samples": 8, "fp16": False},
        **over})
    return run_export(job)


def test_an_int8_detector_is_gated_by_map(detector: TrainedDetector, tmp_path: Path) -> None:
    from exporters.detection.outputs import as_scored, unpack
    from exporters.gates import gate_scores
    from exporters.runtime import TorchRunner, predict
    from hpc_core.tasks.detection.metrics import evaluate_detections

    report = run_detector_export(detector, tmp_path / "out")
    assert report.status == "passed" and report.winner == "int8", report.fallback_reason
    m = report.attempts[0].measurement
    assert m.gate_metric == "map" and m.samples == 24
    assert 0.3 < m.reference_map50 <= 1 and m.map50 is not None and m.map50_drop_pts <= 5.0
    assert np.isnan(m.max_abs_logit_delta)  # no logits after NMS
    # the reference is torchvision's own detections, scored by pycocotools directly
    from hpc_core.config import DataConfig
    from hpc_core.tasks.detection.sources import build_detection_datasets

    _, val, _ = build_detection_datasets(DataConfig.model_validate(detector.data()))
    x = torch.stack([val[i][0] for i in range(len(val))]).numpy()
    preds = predict(TorchRunner(detector.model()), x, batch=8)
    truth = [{"boxes": t["boxes"].numpy(), "labels": t["labels"].numpy() - 1}
             for _, t in (val[i] for i in range(len(val)))]
    want = evaluate_detections([{**p, "labels": p["labels"] - 1} for p in preds], truth,
                               ["square", "circle"])
    assert m.reference_top1 == pytest.approx(want.map)
    assert m.reference_map50 == pytest.approx(want.map_50)
    # the installed file serves the four outputs; its detections score what the gate said
    served = ort_session(tmp_path / "out" / "model.onnx")
    assert [o.name for o in served.get_outputs()] == list(OUTPUT_NAMES)
    from exporters.ort_runner import OrtRunner

    packed = predict(OrtRunner(tmp_path / "out" / "model.onnx", threads=1), x, batch=8)
    assert len(unpack(packed)) == len(x)
    labels = DetectionForm().held_out(val, None)[1]
    assert gate_scores("detection", packed, labels)["map50"] == pytest.approx(m.map50)
    assert as_scored(packed, labels)[1][0]["labels"].min() >= 1  # the task's label offset
    # only the core is quantized: decoding and NMS are float nodes after the head
    g = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert any(n.op_type == "QuantizeLinear" for n in g.node)
    assert not [n for n in g.node if n.name.startswith("tail/") and "Quant" in n.op_type]
    assert any(n.op_type == "NonMaxSuppression" for n in g.node)


def make_fragile(det: TrainedDetector, root: Path, scale: float = 1000.0) -> tuple[Path, str]:
    """A copy of the checkpoint whose project convolution in the backbone's third block has
    one input channel scaled up ``scale`` times, that channel's producer (BatchNorm before a
    ReLU) scaled down as much: the same FP32 function, but that convolution's weights and
    input no longer fit one INT8 scale. Returns the checkpoint and the conv's weight name."""
    from safetensors.torch import save_file

    ckpt = root / "fragile"
    shutil.copytree(det.checkpoint, ckpt)
    model = det.model()
    block = model.backbone.features[0][2].block
    bn, conv = block[1][1], block[2][0]
    with torch.no_grad():
        bn.weight[0] /= scale
        bn.bias[0] /= scale
        conv.weight[:, 0] *= scale
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(ckpt / "model.safetensors"))
    return ckpt, "ssd.backbone.features.0.2.block.2.0.weight"


def test_the_sensitivity_search_keeps_the_fragile_layer_in_float(
        detector: TrainedDetector, tmp_path: Path) -> None:
    ckpt, weight = make_fragile(detector, tmp_path)
    report = run_detector_export(detector, tmp_path / "out", ckpt, keep_intermediates=True)
    steps = [a.step for a in report.attempts]
    assert steps[:2] == ["int8", "int8-exclude-1"], steps
    first, second = report.attempts[:2]
    assert not first.passed and any("mAP@0.5 drop" in f or "map drop" in f
                                    for f in first.failures), first.failures
    assert second.passed and report.winner == "int8-exclude-1", report.fallback_reason
    # the layer kept in float is the fragile convolution: the node whose weight it is
    fragile = report.sensitivity[0]["node"]
    assert second.excluded == [fragile]
    prep = onnx.load(str(tmp_path / "out" / "work" / "fp32.prep.onnx")).graph
    node = next(n for n in prep.node if n.name == fragile)
    init = {i.name: i for i in prep.initializer}
    w = onnx.numpy_helper.to_array(init[node.input[1]])
    want = detector.model().backbone.features[0][2].block[2][0].weight.detach().numpy()
    assert w.shape == want.shape and np.abs(w[:, 0]).max() > 100 * np.abs(w[:, 1:]).max()
    assert weight.endswith("block.2.0.weight")
    # the ranking is measured on the raw head, a clear first
    s = [r["logit_mse"] for r in report.sensitivity]
    assert s[0] > 10 * s[1]


def test_an_fp16_detector_keeps_its_float32_tail(detector: TrainedDetector,
                                                  tmp_path: Path) -> None:
    report = run_detector_export(detector, tmp_path / "out", precision="fp16")
    assert report.winner == "fp16", report.fallback_reason
    m = report.attempts[0].measurement
    assert abs(m.map50_drop_pts) <= 1.0  # FP16 of a 64 px SSDlite: the same detections, nearly
    g = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert [o.name for o in g.output] == list(OUTPUT_NAMES)
    fp16 = {i.name for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT16}
    assert fp16 and not [n for n in g.node if n.name.startswith("tail/")
                         and any(i in fp16 for i in n.input)]  # the tail stays float32
