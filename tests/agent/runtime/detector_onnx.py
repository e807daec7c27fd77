"""A tiny real detector-shaped ONNX model, built with ``onnx.helper`` (no torch): a float32
image batch ``input [N, 3, 16, 16]`` in, the four outputs of TensorRT's ``EfficientNMS_TRT``
plugin out, every one computed from the input so that each changes with it:

- ``num_detections [N, 1]`` INT32: how many of the K scores exceed 0.5;
- ``boxes [N, K, 4]`` FP32: a linear map of the image, plus ``version``;
- ``scores [N, K]`` FP32: a sigmoid of another linear map;
- ``classes [N, K]`` INT32: ``floor(3 * score)``, -1 where the score is 0.5 or less (padding).

``version`` shifts the boxes (and the scores' bias), so two versions answer differently and a
test tells from an answer which version gave it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tests.agent.runtime.conftest import save_graph

K = 5
SIZE = 16
INPUT_SHAPE = (3, SIZE, SIZE)
OUTPUTS = ("num_detections", "boxes", "scores", "classes")
DATATYPES = {"num_detections": "INT32", "boxes": "FP32", "scores": "FP32", "classes": "INT32"}
SHAPES = {"num_detections": [-1, 1], "boxes": [-1, K, 4], "scores": [-1, K],
          "classes": [-1, K]}


def tiny_detector_onnx(path: Path, version: int) -> Path:
    """Write the model for ``version`` to ``path``."""
    rng = np.random.default_rng(0)
    flat = int(np.prod(INPUT_SHAPE))
    consts = {
        "w_box": (rng.standard_normal((flat, K * 4)) * 4).astype(np.float32),
        "b_box": np.full(K * 4, float(version), np.float32),
        "w_score": (rng.standard_normal((flat, K)) / 4).astype(np.float32),
        "b_score": np.full(K, 0.1 * version, np.float32),
        "box_shape": np.array([-1, K, 4], np.int64),
        "half": np.array(0.5, np.float32),
        "three": np.array(3.0, np.float32),
        "pad": np.array(-1, np.int32),
        "axis1": np.array([1], np.int64),
    }
    n = helper.make_node
    nodes = [
        n("Flatten", ["input"], ["flat"], axis=1),
        n("MatMul", ["flat", "w_box"], ["box_mm"]),
        n("Add", ["box_mm", "b_box"], ["box_flat"]),
        n("Reshape", ["box_flat", "box_shape"], ["boxes"]),
        n("MatMul", ["flat", "w_score"], ["score_mm"]),
        n("Add", ["score_mm", "b_score"], ["score_logit"]),
        n("Sigmoid", ["score_logit"], ["scores"]),
        n("Greater", ["scores", "half"], ["kept"]),
        n("Cast", ["kept"], ["kept_i"], to=TensorProto.INT32),
        n("ReduceSum", ["kept_i", "axis1"], ["num_detections"], keepdims=1),
        n("Mul", ["scores", "three"], ["score3"]),
        n("Floor", ["score3"], ["class_f"]),
        n("Cast", ["class_f"], ["class_i"], to=TensorProto.INT32),
        n("Where", ["kept", "class_i", "pad"], ["classes"]),
    ]
    out = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "tiny_detector",
        [out("input", TensorProto.FLOAT, ["batch", *INPUT_SHAPE])],
        [out("num_detections", TensorProto.INT32, ["batch", 1]),
         out("boxes", TensorProto.FLOAT, ["batch", K, 4]),
         out("scores", TensorProto.FLOAT, ["batch", K]),
         out("classes", TensorProto.INT32, ["batch", K])],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    return save_graph(graph, path)


def reference(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """ONNX Runtime's own run of the file on ``x`` (a session of its own, CPU, defaults)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip(OUTPUTS, session.run(list(OUTPUTS), {"input": x}), strict=True))


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, *INPUT_SHAPE), dtype=np.float32)
