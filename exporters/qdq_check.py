"""Structural check of a Q/DQ ONNX model against what TensorRT's explicit quantization takes.

TensorRT builds INT8 engines from Q/DQ graphs only when quantization is symmetric (every
zero-point 0), signed 8-bit, per-tensor for activations and per-channel along the output
channels for weights (opset >= 13 for per-channel). A graph that breaks any of this may
still run in ONNX Runtime and then fail to build — or build with silent fallbacks — on the
device; this check finds it first, on any ONNX file.

Rules (each violation names its node and rule):
- ``opset``: default-domain opset >= 13.
- ``no-qdq``: the graph has no QuantizeLinear/DequantizeLinear at all.
- ``int8``: zero-points are int8 (an omitted zero-point means uint8).
- ``zero-point``: every zero-point is 0.
- ``activation-per-tensor``: activation scales are scalars.
- ``weight-per-channel``: weight scales are 1-D along the consumer's output-channel axis
  (axis 0 for Conv, and for Gemm with transB=1 as exported from nn.Linear).
- ``bias-dq``: no int32 DequantizeLinear (TensorRT accepts only 8-bit inputs to DQ; keep
  biases in float).
- ``uint8`` and ``reduce-range``: (``u8s8-reduce-range`` recipe only, which is for ONNX
  Runtime and never goes to TensorRT) activation zero-points are uint8 and int8 weights lie in
  [-64, 64] (255 x 64 x 2 = 32,640 fits the 16-bit pair sums of x86 without VNNI).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from exporters.onnx_weights import WEIGHTED_OPS, attribute, constants, load, producers

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class Violation:
    node: str
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.node}: [{self.rule}] {self.detail}"


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0


def _weight_axis(dq: onnx.NodeProto, users: list[onnx.NodeProto], ndim: int) -> int | None:
    """Output-channel axis of the weight that ``dq`` feeds, or None if it feeds no layer."""
    for u in users:
        if u.op_type not in WEIGHTED_OPS or len(u.input) < 2 or u.input[1] != dq.output[0]:
            continue
        if u.op_type == "Conv" or (u.op_type == "Gemm" and attribute(u, "transB", 0)):
            return 0
        return ndim - 1
    return None


def check_qdq(
    model: onnx.ModelProto | str | Path,
    *,
    require_per_channel_weights: bool = True,
    activations_signed: bool = True,
) -> list[Violation]:
    """Every way ``model`` departs from symmetric int8 Q/DQ; an empty list means it passes.

    ``activations_signed=False`` checks the ONNX-Runtime-only ``u8s8-reduce-range`` recipe:
    activations may then be uint8 with any zero-point; weights keep every other rule.
    """
    model = load(model)
    violations: list[Violation] = []
    opset = _default_opset(model)
    if opset < 13:
        violations.append(Violation("(model)", "opset", f"opset {opset} < 13: per-channel "
                                    "Q/DQ needs 13 or newer"))
    qdq = [n for n in model.graph.node if n.op_type in QDQ_OPS]
    if not qdq:
        violations.append(Violation("(model)", "no-qdq", "no QuantizeLinear/DequantizeLinear: "
                                    "not a quantized model"))
        return violations
    consts, made_by, users = constants(model), producers(model), _consumers(model)
    for node in qdq:
        name = node.name or node.output[0]
        x = node.input[0]
        x_const = consts.get(x)
        if node.op_type == "DequantizeLinear" and x_const is not None and x_const.dtype == np.int32:
            violations.append(Violation(name, "bias-dq", "int32 DequantizeLinear (quantized "
                                        "bias): keep biases in float for TensorRT"))
            continue
        is_weight = x_const is not None or (
            node.op_type == "DequantizeLinear"
            and made_by.get(x) is not None
            and made_by[x].op_type == "QuantizeLinear"
            and made_by[x].input[0] in consts
        )
        zp = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if not is_weight and not activations_signed:
            # u8s8-reduce-range: uint8 activations over their whole range, any zero-point.
            if zp is not None and zp.dtype != np.uint8:
                violations.append(Violation(name, "uint8", f"activation zero-point type "
                                            f"{zp.dtype}, want uint8 (u8s8 recipe)"))
        elif zp is None:
            violations.append(Violation(name, "int8", "no zero-point: ONNX then means uint8"))
        else:
            if zp.dtype != np.int8:
                violations.append(Violation(name, "int8", f"zero-point type {zp.dtype}, want int8"))
            if np.any(zp != 0):
                violations.append(Violation(
                    name, "zero-point",
                    f"non-zero zero-point(s) {np.unique(zp)[:4].tolist()}: asymmetric"))
        if (not activations_signed and x_const is not None and x_const.dtype == np.int8
                and (x_const.min() < -64 or x_const.max() > 64)):
            violations.append(Violation(
                name, "reduce-range", f"int8 weights span [{x_const.min()}, {x_const.max()}]: "
                "the u8s8 recipe needs weights in [-64, 64] or x86 without VNNI saturates"))
        scale = consts.get(node.input[1])
        if scale is None:
            violations.append(Violation(name, "scale", "scale is not a constant"))
            continue
        if node.op_type == "QuantizeLinear" and x_const is not None:
            continue  # the Q of a weight Q/DQ pair: its DQ carries the same parameters
        if not is_weight:
            if scale.size != 1:
                violations.append(Violation(name, "activation-per-tensor",
                                            f"activation scale has {scale.size} values"))
            continue
        weight = x_const if x_const is not None else consts[made_by[x].input[0]]
        want = _weight_axis(node, users.get(node.output[0], []), weight.ndim)
        if scale.size == 1:
            if require_per_channel_weights:
                violations.append(Violation(name, "weight-per-channel",
                                            "per-tensor weight scale"))
            continue
        axis = int(attribute(node, "axis", 1))  # type: ignore[call-overload]
        axis = axis + weight.ndim if axis < 0 else axis
        if want is not None and axis != want:
            violations.append(Violation(name, "weight-per-channel",
                                        f"scales along axis {axis}, want {want} (output channels)"))
        elif scale.size != weight.shape[axis]:
            violations.append(Violation(name, "weight-per-channel",
                                        f"{scale.size} scales for {weight.shape[axis]} channels"))
    return violations


def main(argv: list[str] | None = None) -> int:
    """``python -m exporters.qdq_check MODEL.onnx ...``: exit 1 when any file has violations."""
    import argparse

    from registry.lifetime import skip_startup_and_exit_collections

    skip_startup_and_exit_collections()

    ap = argparse.ArgumentParser(
        prog="python -m exporters.qdq_check",
        description="Check ONNX files for TensorRT-compatible symmetric int8 Q/DQ: zero-points "
        "0, int8, per-tensor activations, per-channel weights on the output-channel axis, "
        "opset >= 13, no int32 bias DequantizeLinear.",
    )
    ap.add_argument("models", nargs="+", type=Path, metavar="MODEL.onnx")
    ap.add_argument("--allow-per-tensor-weights", action="store_true",
                    help="accept weights with one scale (TensorRT takes them; accuracy suffers)")
    ap.add_argument("--recipe", choices=["s8s8-symmetric", "u8s8-reduce-range"],
                    default="s8s8-symmetric",
                    help="the INT8 recipe the file was made with: s8s8-symmetric (TensorRT's "
                    "rules, the default) or u8s8-reduce-range (ONNX Runtime on x86 without "
                    "VNNI: uint8 activations, weights in [-64, 64])")
    args = ap.parse_args(argv)
    failed = 0
    for path in args.models:
        found = check_qdq(path, require_per_channel_weights=not args.allow_per_tensor_weights,
                          activations_signed=args.recipe == "s8s8-symmetric")
        print(f"{path}: {'OK' if not found else f'{len(found)} violation(s)'}")
        for v in found:
            print(f"  {v}")
        failed += bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
