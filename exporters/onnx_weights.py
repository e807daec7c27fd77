"""Weights of an ONNX graph as the runtime will see them, and their 2:4 pattern.

Works on float graphs and on Q/DQ graphs alike: a Conv/Gemm/MatMul weight is either an
initializer, or the output of a DequantizeLinear fed by an int8 initializer (ONNX Runtime's
layout), or by a QuantizeLinear of a float initializer (the weight Q/DQ pair some tools
emit). Zero stays zero under symmetric quantization, so the 2:4 check reads whichever tensor
holds the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")


@dataclass
class WeightRef:
    node: str
    op_type: str
    name: str
    """The initializer that stores the weight (int8 or float)."""
    array: np.ndarray
    input_axis: int
    """Axis of the input channels (where 2:4 groups run)."""
    output_axis: int
    """Axis of the output channels (where per-channel scales run)."""


def load(model: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    return model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))


def attribute(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node outputs by tensor name."""
    out = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            value = attribute(n, "value", None)
            if isinstance(value, onnx.TensorProto):
                out[n.output[0]] = numpy_helper.to_array(value)
    return out


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: n for n in model.graph.node for out in n.output}


def _stored_weight(
    tensor: str, consts: dict[str, np.ndarray], made_by: dict[str, onnx.NodeProto]
) -> str | None:
    """Follow DequantizeLinear / QuantizeLinear back to the initializer holding ``tensor``."""
    for _ in range(3):
        if tensor in consts:
            return tensor
        node = made_by.get(tensor)
        if node is None or node.op_type not in ("DequantizeLinear", "QuantizeLinear", "Cast"):
            return None
        tensor = node.input[0]
    return None


def _axes(node: onnx.NodeProto, ndim: int) -> tuple[int, int]:
    """(input axis, output axis) of the weight of ``node``."""
    if node.op_type == "Conv":
        return 1, 0
    if node.op_type == "Gemm" and attribute(node, "transB", 0):
        return 1, 0
    return ndim - 2, ndim - 1  # Gemm without transB, MatMul: weight is [in, out]


def weight_refs(model: onnx.ModelProto | str | Path) -> list[WeightRef]:
    model = load(model)
    consts, made_by = constants(model), producers(model)
    refs = []
    for node in model.graph.node:
        if node.op_type not in WEIGHTED_OPS or len(node.input) < 2:
            continue
        name = _stored_weight(node.input[1], consts, made_by)
        if name is None:
            continue  # a MatMul of two activations
        array = consts[name]
        if array.ndim < 2:
            continue
        in_axis, out_axis = _axes(node, array.ndim)
        refs.append(WeightRef(node.name, node.op_type, name, array, in_axis, out_axis))
    return refs


def semi_structured_violations(array: np.ndarray, axis: int) -> int | None:
    """Groups of four along ``axis`` holding more than two non-zeros; None if the axis is not
    a multiple of four (such a layer cannot be 2:4 and is skipped by pruning too)."""
    if array.shape[axis] % 4:
        return None
    groups = np.moveaxis(array, axis, -1).reshape(-1, 4)
    return int(((groups != 0).sum(axis=1) > 2).sum())


@dataclass
class SemiStructuredCheck:
    node: str
    weight: str
    shape: list[int]
    eligible: bool
    """Input channels come in whole groups of four (and groups=1 for Conv)."""
    violations: int
    """Groups of four with more than two non-zeros (0 for a 2:4 weight)."""
    sparsity: float


def check_semi_structured(model: onnx.ModelProto | str | Path) -> list[SemiStructuredCheck]:
    """The 2:4 status of every Conv/Gemm/MatMul weight in the graph."""
    model = load(model)
    checks = []
    conv_groups = {n.name: attribute(n, "group", 1) for n in model.graph.node}
    for ref in weight_refs(model):
        bad = semi_structured_violations(ref.array, ref.input_axis)
        eligible = bad is not None and conv_groups.get(ref.node, 1) == 1
        checks.append(
            SemiStructuredCheck(
                node=ref.node,
                weight=ref.name,
                shape=list(ref.array.shape),
                eligible=eligible,
                violations=bad if eligible and bad is not None else 0,
                sparsity=float((ref.array == 0).mean()),
            )
        )
    return checks
