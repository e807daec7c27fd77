from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from exporters.calibration import representative_inputs
from exporters.gates import top1
from exporters.int8_recipe import TENSORRT_RECIPE
from exporters.job import CalibrationConfig, ExportJob
from exporters.ort_runner import OrtRunner
from exporters.pipeline import run_export
from exporters.quantize import prepare_for_quantization, quantize_int8
from exporters.runtime import predict
from exporters.tensorrt_build import (
    TensorRTConfig,
    TensorRTRunner,
    TensorRTUnavailable,
    build_engine,
    require_tensorrt,
)

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


needs_trt = pytest.mark.skipif(
    not (HAVE_TRT and _cuda()),
    reason="TensorRT is not installed here (engine builds run on a Jetson or a GPU host with the "
    "tensorrt package)" if not HAVE_TRT else "TensorRT engines need a CUDA device",
)
no_trt = pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed: the unavailable path "
                            "cannot be exercised")


@no_trt
def test_missing_tensorrt_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TensorRTUnavailable, match="target=onnxruntime"):
        require_tensorrt()
    with pytest.raises(TensorRTUnavailable):
        build_engine(tmp_path / "m.onnx", tmp_path / "m.engine", precision="int8",
                     sparse_weights=False, input_shape=(1, 8, 8), cfg=TensorRTConfig())


@no_trt
def test_a_tensorrt_job_fails_before_any_work(tmp_path: Path) -> None:
    job = ExportJob(checkpoint=tmp_path / "does-not-exist", out_dir=tmp_path / "out",
                    target="tensorrt", precision="int8")
    with pytest.raises(TensorRTUnavailable):
        run_export(job)
    assert not (tmp_path / "out").exists()


def test_gated_batch_must_fit_the_engine_profile(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"tensorrt\.max_batch"):
        ExportJob(checkpoint=tmp_path, out_dir=tmp_path, target="tensorrt",
                  gates={"batch_size": 64}, tensorrt={"max_batch": 32})


@needs_trt
def test_int8_sparse_engine_from_our_qdq_model(cnn: Any, cnn_fp32: Any, tmp_path: Path) -> None:
    prepared = prepare_for_quantization(cnn_fp32.path, tmp_path / "prep.onnx")
    calib = representative_inputs(cnn.splits()[0], 512)
    q = quantize_int8(prepared, tmp_path / "int8.onnx", calib_inputs=calib, input_name="input",
                      cfg=CalibrationConfig(), recipe=TENSORRT_RECIPE)
    cfg = TensorRTConfig(workspace_mb=256, timing_cache=tmp_path / "cache.bin", max_batch=32)
    info = build_engine(q.path, tmp_path / "m.engine", precision="int8", sparse_weights=True,
                        input_shape=cnn.input_shape, cfg=cfg)
    meta = json.loads(info.metadata_path.read_text())
    assert meta["precision"] == "int8" and meta["sparse_weights"] is True
    assert meta["tensorrt_version"] and meta["workspace_mb"] == 256
    assert (tmp_path / "cache.bin").stat().st_size > 0
    x, y = cnn.held_out()
    engine_acc = top1(predict(TensorRTRunner(info.path), x, batch=32), y)
    ort_acc = top1(predict(OrtRunner(q.path), x), y)
    assert abs(engine_acc - ort_acc) * 100 <= 1.0
