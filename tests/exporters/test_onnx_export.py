from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from pydantic import ValidationError

from exporters.job import OnnxExportConfig
from exporters.onnx_export import export_onnx, opset_of
from exporters.ort_runner import OrtRunner


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_one_file_serves_any_batch_and_matches_torch(cnn: Any, cnn_fp32: Any, batch: int) -> None:
    x, _ = cnn.held_out()
    with torch.no_grad():
        ref = cnn.model()(torch.from_numpy(x[:batch])).numpy()
    out = OrtRunner(cnn_fp32.path)(x[:batch])
    assert out.shape == (batch, 10)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_file_is_checked_self_contained_and_stripped(cnn_fp32: Any) -> None:
    model = onnx.load(str(cnn_fp32.path))
    onnx.checker.check_model(model, full_check=True)
    assert cnn_fp32.opset == opset_of(model) >= 17
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    assert (cnn_fp32.input_name, cnn_fp32.output_name) == ("input", "logits")
    assert all(i.data_location != onnx.TensorProto.EXTERNAL for i in model.graph.initializer)
    assert not any(n.metadata_props or n.doc_string for n in model.graph.node)
    assert list(cnn_fp32.path.parent.iterdir()) == [cnn_fp32.path]  # no temp or .data file
    assert cnn_fp32.size_bytes == cnn_fp32.path.stat().st_size


def test_torchscript_exporter_gives_opset_17(cnn: Any, tmp_path: Path) -> None:
    cfg = OnnxExportConfig(opset=17, exporter="torchscript")
    exported = export_onnx(cnn.model(), tmp_path / "m17.onnx", cnn.input_shape, cfg)
    assert exported.opset == 17
    x, _ = cnn.held_out()
    assert OrtRunner(exported.path)(x[:3]).shape == (3, 10)


def test_dynamo_below_opset_18_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="exporter=torchscript"):
        OnnxExportConfig(opset=17)
    with pytest.raises(ValidationError):
        OnnxExportConfig(opset=13, exporter="torchscript")


def test_requested_simplifier_must_be_installed(cnn: Any, tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("onnxsim") is not None:
        pytest.skip("onnxsim is installed here")
    with pytest.raises(RuntimeError, match="pip install onnxsim"):
        export_onnx(cnn.model(), tmp_path / "m.onnx", cnn.input_shape,
                    OnnxExportConfig(simplify="onnxsim"))
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_export_leaves_the_model_in_its_mode(cnn: Any, tmp_path: Path) -> None:
    model = cnn.model().train()
    export_onnx(model, tmp_path / "m.onnx", cnn.input_shape, OnnxExportConfig(
        exporter="torchscript", opset=17))
    assert model.training
