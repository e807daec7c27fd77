"""The post-processing of an exported detector as an ONNX graph: box decoding and
non-maximum suppression, appended to the quantized core after quantization.

Where NMS lives: inside the exported graph, after the network. The core
(``exporters.detection.core``) ends at the raw head, ``[N, A, C + 4]`` per anchor; this tail
turns it into the fixed-size outputs of ``exporters.detection.outputs``:

1. softmax over the ``C`` classes (background first), boxes decoded from the anchors
   (torchvision's ``BoxCoder``: weights, the ``exp`` clip) and clipped to the image;
2. per class, only the ``topk_candidates`` best scores stay candidates (torchvision's
   SSD does the same before its NMS);
3. ONNX ``NonMaxSuppression`` per class (``score > score_thresh``, IoU ``> nms_thresh``
   suppresses), at most ``K`` kept per class;
4. the ``K`` best kept detections of the image, by score, padded to ``K`` rows.

Every node here stays in float: the tail is built apart from the core and joined to it
(:func:`attach`) after the core was quantized, so no quantizer ever sees it; pixel
coordinates in INT8 would cost whole pixels. The same head maps to TensorRT's
``EfficientNMS_TRT`` plugin (:func:`build_tail` with ``nms="efficient_nms_trt"``): steps 1
stay, steps 2-4 are the plugin's (``background_class=-1`` on the foreground scores,
``score_activation=0``, ``box_coding=0``: corners); the plugin has no per-class
top-k before NMS, so on a crowded image the two may keep different boxes.

Torch-free: ``onnx`` and numpy only; the anchors and settings come from a
:class:`TailSpec` the torch half measured on the model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from exporters.detection.outputs import (
    BOXES,
    CLASSES,
    HEAD_NAME,
    NUM_DETECTIONS,
    OUTPUT_NAMES,
    PAD_CLASS,
    SCORES,
)

NmsKind = Literal["onnx", "efficient_nms_trt"]
TRT_PLUGIN = "EfficientNMS_TRT"
TRT_DOMAIN = "trt.plugins"  # the domain TensorRT's ONNX parser reads plugin nodes from


@dataclass(frozen=True)
class TailSpec:
    """What decoding and NMS need, read off the PyTorch detector (its post-processing
    settings and its anchors at the exported input size)."""

    num_classes: int
    """C: the head's classes, background (index 0) included."""
    image_size: int
    """Input side in pixels: boxes are clipped to [0, image_size]."""
    anchors: list[list[float]]
    """A x 4 anchors (x1, y1, x2, y2 pixels), in the head's anchor order."""
    box_weights: tuple[float, float, float, float]
    bbox_xform_clip: float
    score_thresh: float
    nms_thresh: float
    topk_candidates: int
    detections_per_img: int

    @property
    def k(self) -> int:
        """Rows per image of the outputs."""
        return min(self.detections_per_img, (self.num_classes - 1) * len(self.anchors))

    def save(self, path: Path) -> None:
        from registry.atomic import write_json_atomic

        write_json_atomic(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> TailSpec:
        d = json.loads(path.read_text())
        return cls(**{**d, "box_weights": tuple(d["box_weights"])})


class _Graph:
    """Nodes and constants of the tail, named under one prefix."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, value: np.ndarray | float | int | list[int], dtype: type = np.float32
              ) -> str:
        name = f"tail/const_{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1,
           domain: str = "", **attrs: object) -> str:
        self._n += 1
        name = f"tail/{op_type}_{self._n}"
        outs = ([f"{name}:{i}" for i in range(outputs)] if isinstance(outputs, int)
                else outputs)
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain,
                                           **attrs))
        return outs[0]

    def outs(self) -> list[str]:
        return list(self.nodes[-1].output)


def _decode(g: _Graph, head: str, spec: TailSpec) -> tuple[str, str]:
    """(foreground scores [N, A, C-1], boxes [N, A, 4]) of the raw head."""
    c = spec.num_classes
    axis = g.const([2], np.int64)
    logits = g.op("Slice", [head, g.const([0], np.int64), g.const([c], np.int64), axis])
    reg = g.op("Slice", [head, g.const([c], np.int64), g.const([c + 4], np.int64), axis])
    probs = g.op("Softmax", [logits], axis=-1)
    fg = g.op("Slice", [probs, g.const([1], np.int64), g.const([c], np.int64), axis])
    a = np.asarray(spec.anchors, dtype=np.float32)
    wh = a[:, 2:] - a[:, :2]
    ctr = a[:, :2] + 0.5 * wh
    d = g.op("Div", [reg, g.const(np.asarray(spec.box_weights, np.float32))])
    dxy = g.op("Slice", [d, g.const([0], np.int64), g.const([2], np.int64), axis])
    dwh = g.op("Slice", [d, g.const([2], np.int64), g.const([4], np.int64), axis])
    dwh = g.op("Min", [dwh, g.const(spec.bbox_xform_clip)])
    pred_ctr = g.op("Add", [g.op("Mul", [dxy, g.const(wh)]), g.const(ctr)])
    pred_wh = g.op("Mul", [g.op("Exp", [dwh]), g.const(wh)])
    half = g.op("Mul", [g.const(0.5), pred_wh])
    boxes = g.op("Concat", [g.op("Sub", [pred_ctr, half]), g.op("Add", [pred_ctr, half])],
                 axis=2)
    boxes = g.op("Clip", [boxes, g.const(0.0), g.const(float(spec.image_size))])
    return fg, boxes


def _onnx_nms(g: _Graph, fg: str, boxes: str, spec: TailSpec) -> None:
    a, k = len(spec.anchors), spec.k
    per_class = g.op("Transpose", [fg], perm=[0, 2, 1])  # [N, C-1, A]
    topk = min(spec.topk_candidates, a)
    best = g.op("TopK", [per_class, g.const([topk], np.int64)], 2, axis=-1)
    kth = g.op("Slice", [best, g.const([topk - 1], np.int64), g.const([topk], np.int64),
                         g.const([2], np.int64)])
    zero = g.const(0.0)
    cand = g.op("Where", [g.op("GreaterOrEqual", [per_class, kth]), per_class, zero])
    sel = g.op("NonMaxSuppression", [boxes, cand, g.const([k], np.int64),
                                     g.const([spec.nms_thresh]),
                                     g.const([spec.score_thresh])], center_point_box=0)
    # The kept (image, class, anchor) triples into a dense [N, (C-1) * A] score table, whose
    # top K per image are the detections, already sorted and padded with zeros.
    sel_i, sel_c, sel_a = (g.op("Slice", [sel, g.const([j], np.int64), g.const([j + 1], np.int64),
                                          g.const([1], np.int64)]) for j in range(3))
    flat = g.op("Add", [g.op("Mul", [sel_c, g.const([a], np.int64)]), sel_a])
    where = g.op("Concat", [sel_i, flat], axis=1)
    kept = g.op("GatherND", [cand, sel])
    n = g.op("Slice", [g.op("Shape", [fg]), g.const([0], np.int64), g.const([1], np.int64)])
    shape = g.op("Concat", [n, g.const([(spec.num_classes - 1) * a], np.int64)], axis=0)
    table = g.op("ConstantOfShape", [shape],
                 value=numpy_helper.from_array(np.zeros(1, np.float32)))
    table = g.op("ScatterND", [table, where, kept])
    g.op("TopK", [table, g.const([k], np.int64)], 2, axis=1)
    top_v, top_i = g.outs()
    valid = g.op("Greater", [top_v, zero])
    g.op("ReduceSum", [g.op("Cast", [valid], to=TensorProto.INT32), g.const([1], np.int64)],
         [NUM_DETECTIONS], keepdims=1)
    g.op("Where", [valid, top_v, zero], [SCORES])
    cls = g.op("Cast", [g.op("Div", [top_i, g.const(a, np.int64)])], to=TensorProto.INT32)
    g.op("Where", [valid, cls, g.const(PAD_CLASS, np.int32)], [CLASSES])
    anchor = g.op("Unsqueeze", [g.op("Mod", [top_i, g.const(a, np.int64)]),
                                g.const([2], np.int64)])
    picked = g.op("GatherND", [boxes, anchor], batch_dims=1)
    g.op("Where", [g.op("Unsqueeze", [valid, g.const([2], np.int64)]), picked, zero], [BOXES])


def _efficient_nms(g: _Graph, fg: str, boxes: str, spec: TailSpec) -> None:
    g.op(TRT_PLUGIN, [boxes, fg], list(OUTPUT_NAMES), domain=TRT_DOMAIN,
         background_class=-1, box_coding=0, iou_threshold=spec.nms_thresh,
         max_output_boxes=spec.k, plugin_version="1", score_activation=0,
         score_threshold=spec.score_thresh, class_agnostic=0)


def build_tail(spec: TailSpec, opset: int, nms: NmsKind = "onnx") -> onnx.ModelProto:
    """The tail as a model of its own: ``head`` in, :data:`OUTPUT_NAMES` out."""
    g = _Graph()
    fg, boxes = _decode(g, HEAD_NAME, spec)
    (_onnx_nms if nms == "onnx" else _efficient_nms)(g, fg, boxes, spec)
    k = spec.k
    outputs = [
        helper.make_tensor_value_info(NUM_DETECTIONS, TensorProto.INT32, ["N", 1]),
        helper.make_tensor_value_info(BOXES, TensorProto.FLOAT, ["N", k, 4]),
        helper.make_tensor_value_info(SCORES, TensorProto.FLOAT, ["N", k]),
        helper.make_tensor_value_info(CLASSES, TensorProto.INT32, ["N", k]),
    ]
    head = helper.make_tensor_value_info(
        HEAD_NAME, TensorProto.FLOAT, ["N", len(spec.anchors), spec.num_classes + 4])
    graph = helper.make_graph(g.nodes, "detection_tail", [head], outputs, g.inits)
    imports = [helper.make_opsetid("", opset)]
    if nms == "efficient_nms_trt":
        imports.append(helper.make_opsetid(TRT_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=imports)


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Order ``graph``'s nodes so that each comes after the producers of its inputs: the FP16
    converter appends its input casts at the end, which the checker (and the merge) refuse."""
    ready = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = [n for n in pending if not all(i in ready for i in n.input)]
        placed = [n for n in pending if all(i in ready for i in n.input)]
        if not placed:
            raise ValueError(f"the graph has a cycle or an unknown input at {rest[0].name}")
        for n in placed:
            ordered.append(n)
            ready.update(n.output)
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def attach(core_path: Path, spec: TailSpec, out_path: Path, nms: NmsKind = "onnx") -> Path:
    """The core at ``core_path`` (float or Q/DQ) with the tail joined to its ``head``
    output, written to ``out_path``."""
    from registry.atomic import atomic_output

    core = onnx.load(str(core_path))
    _sort_topologically(core.graph)
    opset = next(int(i.version) for i in core.opset_import if i.domain in ("", "ai.onnx"))
    tail = build_tail(spec, opset, nms)
    for imp in core.opset_import:  # merge_models wants the same imports on both sides
        if imp.domain not in ("", "ai.onnx") and imp.domain not in {
                i.domain for i in tail.opset_import}:
            tail.opset_import.append(helper.make_opsetid(imp.domain, imp.version))
    for imp in tail.opset_import:
        if imp.domain not in {i.domain for i in core.opset_import}:
            core.opset_import.append(helper.make_opsetid(imp.domain, imp.version))
    tail.ir_version = core.ir_version
    merged = onnx.compose.merge_models(core, tail, io_map=[(HEAD_NAME, HEAD_NAME)])
    merged.producer_name = core.producer_name
    with atomic_output(Path(out_path)) as tmp:
        onnx.save(merged, str(tmp))
    if nms == "onnx":
        onnx.checker.check_model(str(out_path), full_check=True)
    return Path(out_path)
