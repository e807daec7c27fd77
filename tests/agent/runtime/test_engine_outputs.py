"""EngineOutputs (one run's outputs by name) and the datatype each output is declared with."""

from __future__ import annotations

import numpy as np
import pytest

from agent.runtime.engine_outputs import (
    EngineOutputs,
    TensorSpec,
    numpy_datatype,
    onnx_datatype,
)


def detector_run(n: int, first: int = 0) -> EngineOutputs:
    rows = np.arange(first, first + n)
    return EngineOutputs(num_detections=rows.astype(np.int32).reshape(n, 1),
                         boxes=np.repeat(rows, 12).astype(np.float32).reshape(n, 3, 4),
                         scores=np.repeat(rows, 3).astype(np.float32).reshape(n, 3),
                         classes=np.repeat(rows, 3).astype(np.int32).reshape(n, 3))


def test_slices_of_a_batch_are_put_back_together_output_by_output() -> None:
    whole = EngineOutputs.concat([detector_run(2), detector_run(2, 2), detector_run(1, 4)])
    want = detector_run(5)
    assert list(whole) == list(want) == ["num_detections", "boxes", "scores", "classes"]
    for name in want:
        assert whole[name].dtype == want[name].dtype
        np.testing.assert_array_equal(whole[name], want[name])
    one = detector_run(3)
    assert EngineOutputs.concat([one]) is one


def test_one_output_reads_as_its_array_several_do_not() -> None:
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = EngineOutputs(logits=logits)
    assert out.sole() is logits and np.asarray(out) is logits
    np.testing.assert_array_equal(np.concatenate([out, out]), np.concatenate([logits, logits]))
    copied = np.array(out, copy=True)
    assert copied is not logits and np.array_equal(copied, logits)
    assert np.asarray(out, dtype=np.float64).dtype == np.float64
    with pytest.raises(TypeError, match=r"4 outputs \(num_detections, boxes, scores, classes\)"):
        np.asarray(detector_run(2))


def test_datatypes_of_onnx_and_numpy_types() -> None:
    assert onnx_datatype("tensor(int32)", "classes") == "INT32"
    assert onnx_datatype("tensor(float)", "boxes") == "FP32"
    assert onnx_datatype("tensor(int64)", "labels") == "INT64"
    with pytest.raises(ValueError, match="output 'names' is a tensor\\(string\\): this server "
                                         "answers numeric tensors only"):
        onnx_datatype("tensor(string)", "names")
    assert numpy_datatype(np.int32, "classes") == "INT32"
    assert numpy_datatype(np.dtype(">f4"), "boxes") == "FP32"
    assert numpy_datatype(np.float16, "x") == "FP16"
    with pytest.raises(ValueError, match="complex64"):
        numpy_datatype(np.complex64, "z")
    spec = TensorSpec("boxes", "FP32", (-1, 100, 4))
    assert spec.fits([2, 100, 4]) and not spec.fits([2, 99, 4])
    assert spec.metadata() == {"name": "boxes", "datatype": "FP32", "shape": [-1, 100, 4]}
