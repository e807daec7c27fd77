from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

from exporters.calibration import BatchReader, representative_inputs
from exporters.int8_recipe import TENSORRT_RECIPE
from exporters.job import CalibrationConfig
from exporters.qdq_check import check_qdq
from exporters.quantize import prepare_for_quantization, qdq_options, quantize_int8


@pytest.fixture(scope="module")
def prepared(cnn: Any, cnn_fp32: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_for_quantization(cnn_fp32.path, tmp_path_factory.mktemp("qdq") / "prep.onnx")


@pytest.fixture(scope="module")
def calib(cnn: Any) -> np.ndarray:
    return representative_inputs(cnn.splits()[0], 128)


def _ort_quantize(prepared: Path, calib: np.ndarray, out: Path, **overrides: Any) -> Path:
    """quantize_static with our recipe, one setting changed."""
    options = qdq_options(TENSORRT_RECIPE)
    kwargs: dict[str, Any] = {
        "activation_type": QuantType.QInt8, "weight_type": QuantType.QInt8, "per_channel": True,
    }
    for k, v in overrides.items():
        (kwargs if k in kwargs else options)[k] = v
    quantize_static(str(prepared), str(out), BatchReader(calib, "input", 64),
                    quant_format=QuantFormat.QDQ, extra_options=options, **kwargs)
    return out


def _rules(path: Path, **kw: Any) -> set[str]:
    return {v.rule for v in check_qdq(path, **kw)}


def test_our_quantizer_output_passes(prepared: Path, calib: np.ndarray, tmp_path: Path) -> None:
    out = quantize_int8(prepared, tmp_path / "q.onnx", calib_inputs=calib, input_name="input",
                        cfg=CalibrationConfig(samples=128), recipe=TENSORRT_RECIPE)
    assert check_qdq(out.path) == []


def test_asymmetric_activations_fail_on_zero_points(
    prepared: Path, calib: np.ndarray, tmp_path: Path
) -> None:
    out = _ort_quantize(prepared, calib, tmp_path / "asym.onnx", ActivationSymmetric=False)
    violations = check_qdq(out)
    assert {v.rule for v in violations} == {"zero-point"}
    assert all("asymmetric" in v.detail for v in violations)


def test_uint8_activations_fail(prepared: Path, calib: np.ndarray, tmp_path: Path) -> None:
    out = _ort_quantize(prepared, calib, tmp_path / "u8.onnx", activation_type=QuantType.QUInt8,
                        ActivationSymmetric=False)
    assert {"int8", "zero-point"} <= _rules(out)


def test_per_tensor_weights_fail_when_per_channel_is_required(
    prepared: Path, calib: np.ndarray, tmp_path: Path
) -> None:
    out = _ort_quantize(prepared, calib, tmp_path / "pt.onnx", per_channel=False)
    assert _rules(out) == {"weight-per-channel"}
    assert check_qdq(out, require_per_channel_weights=False) == []


def test_int32_biases_fail(prepared: Path, calib: np.ndarray, tmp_path: Path) -> None:
    out = _ort_quantize(prepared, calib, tmp_path / "bias.onnx", QuantizeBias=True)
    assert _rules(out) == {"bias-dq"}


def test_a_float_model_is_not_a_qdq_model(cnn_fp32: Any) -> None:
    assert _rules(cnn_fp32.path) == {"no-qdq"}


def _tiny_conv_qdq(opset: int, axis: int, zero_point: int = 0) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, 2, 3, 3), np.int8), "w_q")
    w_scale = numpy_helper.from_array(np.full(4 if axis == 0 else 2, 0.1, np.float32), "w_s")
    w_zp = numpy_helper.from_array(np.zeros(4 if axis == 0 else 2, np.int8), "w_zp")
    a_scale = numpy_helper.from_array(np.array(0.02, np.float32), "a_s")
    a_zp = numpy_helper.from_array(np.array(zero_point, np.int8), "a_zp")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "a_s", "a_zp"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "a_s", "a_zp"], ["xd"], name="dq_x"),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w"], name="dq_w",
                         axis=axis),
        helper.make_node("Conv", ["xd", "w"], ["y"], name="conv"),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 3, 3])],
        [w, w_scale, w_zp, a_scale, a_zp],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_hand_built_graphs() -> None:
    assert check_qdq(_tiny_conv_qdq(13, axis=0)) == []
    assert _rules(_tiny_conv_qdq(10, axis=0)) == {"opset"}
    wrong_axis = check_qdq(_tiny_conv_qdq(13, axis=1))
    assert [(v.node, v.rule) for v in wrong_axis] == [("dq_w", "weight-per-channel")]
    assert "want 0" in wrong_axis[0].detail
    shifted = check_qdq(_tiny_conv_qdq(13, axis=0, zero_point=3))
    assert {(v.node, v.rule) for v in shifted} == {("q_x", "zero-point"), ("dq_x", "zero-point")}


def test_command_line_exit_status(
    prepared: Path, calib: np.ndarray, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from exporters.qdq_check import main

    ours = quantize_int8(prepared, tmp_path / "q.onnx", calib_inputs=calib, input_name="input",
                         cfg=CalibrationConfig(samples=128), recipe=TENSORRT_RECIPE).path
    asym = _ort_quantize(prepared, calib, tmp_path / "asym.onnx", ActivationSymmetric=False)
    assert main([str(ours)]) == 0
    assert main([str(ours), str(asym)]) == 1
    out = capsys.readouterr().out
    assert f"{ours}: OK" in out and "[zero-point]" in out
