from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from exporters.job import PruneSpec
from exporters.onnx_export import export_onnx
from exporters.onnx_weights import check_semi_structured, semi_structured_violations, weight_refs
from exporters.prune import prune_model


def test_counts_groups_with_more_than_two_nonzeros() -> None:
    w = np.array([[1, 0, 2, 0, 1, 1, 1, 0]], np.float32)  # second group has three
    assert semi_structured_violations(w, axis=1) == 1
    assert semi_structured_violations(w[:, :4], axis=1) == 0
    assert semi_structured_violations(np.ones((2, 6)), axis=1) is None  # 6 is not 4k


def test_weights_resolve_to_layers_with_their_axes(cnn_fp32: Any) -> None:
    refs = {r.node: r for r in weight_refs(cnn_fp32.path)}
    assert sorted(r.op_type for r in refs.values()) == ["Conv", "Conv", "Conv", "Gemm"]
    gemm = next(r for r in refs.values() if r.op_type == "Gemm")
    assert gemm.array.shape == (10, 128) and (gemm.input_axis, gemm.output_axis) == (1, 0)


def test_2_4_pruned_export_checks_clean_and_a_dense_one_does_not(
    cnn: Any, cnn_fp32: Any, tmp_path: Path
) -> None:
    model = cnn.model()
    prune_model(model, PruneSpec.model_validate("2:4"), torch.zeros(1, *cnn.input_shape))
    pruned = export_onnx(model, tmp_path / "sparse.onnx", cnn.input_shape)
    checks = check_semi_structured(pruned.path)
    eligible = [c for c in checks if c.eligible]
    assert len(eligible) == 3 and all(c.violations == 0 for c in eligible)
    assert [c.eligible for c in checks].count(False) == 1  # the 1-channel input conv
    dense = [c for c in check_semi_structured(cnn_fp32.path) if c.eligible]
    assert all(c.violations > 0 for c in dense)


def test_one_revived_weight_is_caught(cnn: Any, tmp_path: Path) -> None:
    model = cnn.model()
    prune_model(model, PruneSpec.model_validate("2:4"), torch.zeros(1, *cnn.input_shape))
    path = export_onnx(model, tmp_path / "sparse.onnx", cnn.input_shape).path
    proto = onnx.load(str(path))
    ref = next(r for r in weight_refs(proto) if r.op_type == "Gemm")
    arr = ref.array.copy()
    arr[3, np.flatnonzero(arr[3] == 0)[0]] = 0.5
    init = next(i for i in proto.graph.initializer if i.name == ref.name)
    init.CopyFrom(numpy_helper.from_array(arr, ref.name))
    bad = [c for c in check_semi_structured(proto) if c.violations]
    assert [(c.node, c.violations) for c in bad] == [(ref.node, 1)]
