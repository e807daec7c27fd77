"""INT8 post-training quantization with ONNX Runtime, in Q/DQ form, by recipe.

``quantize_static`` in QDQ format with per-channel weights (axis 0 = output channels) and
symmetric weight ranges. The activations follow the recipe (``exporters.int8_recipe``):
``s8s8-symmetric`` makes every zero-point 0 and every tensor int8, which TensorRT's explicit
quantization requires (ONNX Runtime's ``ActivationSymmetric`` defaults to False, which
TensorRT rejects) — the same file then runs in ONNX Runtime and builds a TensorRT engine;
``u8s8-reduce-range`` uses uint8 activations over their whole range and weights in [-64, 64], the
fast exact form for ONNX Runtime on x86 without VNNI. Biases stay in float: ONNX Runtime
would otherwise emit int32 DequantizeLinear nodes, which TensorRT's parser refuses.

Where ONNX Runtime supports it (``calibration_cache_path``, new in 2026 releases; JetPack
builds are older) the activation ranges are computed once and cached, so re-quantizing with
layers excluded — the gate fallback — costs no second calibration pass; elsewhere each
quantization calibrates again, with the same samples and so the same ranges.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import io
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

from exporters.calibration import (
    BatchReader,
    CalibrationConfig,
    ort_calibration_method,
    ort_calibration_options,
)
from exporters.int8_recipe import Int8Recipe
from exporters.onnx_weights import WEIGHTED_OPS
from registry.atomic import atomic_output


def qdq_options(recipe: Int8Recipe) -> dict[str, object]:
    """``quantize_static`` extra options of ``recipe``; ``exporters.qdq_check`` verifies the
    structure they produce."""
    return {
        "ActivationSymmetric": recipe.activations_signed,
        "WeightSymmetric": True,
        "QuantizeBias": False,
    }


CACHE_SUPPORTED = "calibration_cache_path" in inspect.signature(quantize_static).parameters


@dataclass
class QuantizeResult:
    path: Path
    recipe: Int8Recipe
    excluded: list[str]
    size_bytes: int
    seconds: float


@contextlib.contextmanager
def _quiet_ort() -> Iterator[None]:
    # The calibrators print progress to stdout and log advice at WARNING; a CLI run shows
    # its own summary instead.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def ort_tools_without_torch() -> None:
    """Make ``onnxruntime.tools`` importable without torch, for ``quant_pre_process``.

    Its symbolic shape inference lives in ``onnxruntime.tools``, whose ``__init__`` imports
    ONNX Runtime's PyTorch export helpers, and so torch, whenever torch is installed. The
    export's ONNX Runtime half (``agent.jobs.steps.export``'s ``export`` child, a process of
    its own so that it stays within the job's memory budget) uses none of torch, yet loaded
    all of it there: on the demo's digits model its peak RSS was 308 MB with torch and is
    121 MB without, its CPU 2.3 s and 0.85 s (``tests/exporters/test_quantize.py::
    test_quantizing_loads_no_torch`` keeps torch out). Registered from its spec
    without running that ``__init__``, the package still finds its modules; nothing here
    uses the one name the ``__init__`` adds (``infer_input_info``). A process that imported
    the package already keeps it as it is."""
    if "onnxruntime.tools" in sys.modules:
        return
    spec = importlib.util.find_spec("onnxruntime.tools")
    if spec is None:
        return  # a build without the tools: quant_pre_process says what is missing
    tools = importlib.util.module_from_spec(spec)  # its __path__, not its __init__
    sys.modules["onnxruntime.tools"] = tools
    onnxruntime.tools = tools  # type: ignore[attr-defined]


def prepare_for_quantization(fp32_path: Path, out_path: Path) -> Path:
    """Shape inference and graph clean-up (BatchNorm folding, constant folding) that ONNX
    Runtime recommends before calibration; node names are those of this file."""
    ort_tools_without_torch()
    with _quiet_ort(), atomic_output(Path(out_path)) as tmp:
        quant_pre_process(str(fp32_path), str(tmp))
    return Path(out_path)


def quantizable_nodes(model_path: Path) -> list[str]:
    """Names of the layers whose weights INT8 quantizes (candidates for exclusion)."""
    model = onnx.load(str(model_path))
    init = {i.name for i in model.graph.initializer}
    return [
        n.name
        for n in model.graph.node
        if n.op_type in WEIGHTED_OPS and len(n.input) > 1 and n.input[1] in init
    ]


def float_parameter_nodes(model_path: Path) -> list[str]:
    """Nodes other than Conv/Gemm/MatMul that take a float constant: the affine gamma/beta
    of a normalization (GroupNorm exports as InstanceNormalization + Mul + Add), scalar
    Mul/Add constants. ONNX Runtime would quantize those constants per tensor, which the
    symmetric per-channel recipe (and ``exporters.qdq_check``) rejects, and an INT8 gamma
    saves nothing: TensorRT fuses these ops into the float epilogue. They stay in float.

    Read once per version of the file (its path, inode, size and change time: an atomic
    rewrite is a new inode): a layer sensitivity ranking quantizes one file ~100 times."""
    st = Path(model_path).stat()
    version = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return list(_float_parameter_nodes(str(model_path), version))


@functools.lru_cache(maxsize=8)
def _float_parameter_nodes(path: str, version: tuple[int, ...]) -> tuple[str, ...]:
    model = onnx.load(path)
    floats = {
        i.name for i in model.graph.initializer
        if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    }
    return tuple(
        n.name
        for n in model.graph.node
        if n.op_type not in WEIGHTED_OPS and any(x in floats for x in n.input)
    )


ACTIVATION_OPS = ("Relu", "Clip", "LeakyRelu", "HardSwish", "HardSigmoid", "Sigmoid", "Tanh")
"""Elementwise activations ONNX Runtime quantizes at their output: the tensor they feed a
layer is then quantized whether or not that layer is."""


def with_float_inputs(model_path: Path, nodes: Sequence[str]) -> list[str]:
    """``nodes`` plus the activations that feed only them (a conv's ReLU), so that a layer
    left in float also takes its input in float: excluding the conv alone leaves the Q/DQ
    pair on its input, where a tensor whose channels differ by orders of magnitude loses
    the small ones."""
    if not nodes:
        return []
    model = onnx.load(str(model_path))
    producer = {o: n for n in model.graph.node for o in n.output}
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    by_name = {n.name: n for n in model.graph.node}
    out = list(nodes)
    for name in nodes:
        node = by_name.get(name)
        while node is not None and node.input:
            p = producer.get(node.input[0])
            if p is None or p.op_type not in ACTIVATION_OPS or uses.get(node.input[0], 0) != 1:
                break
            out.append(p.name)
            node = p
    return out


def _overrides(ranges: dict[str, float] | None) -> dict[str, object]:
    if not ranges:
        return {}
    return {"TensorQuantOverrides": {
        name: [{"rmin": np.float32(-r), "rmax": np.float32(r)}] for name, r in ranges.items()}}


def quantize_int8(
    fp32_path: Path,
    out_path: Path,
    *,
    calib_inputs: np.ndarray,
    input_name: str,
    cfg: CalibrationConfig,
    recipe: Int8Recipe,
    cache_path: Path | None = None,
    nodes_to_exclude: Sequence[str] = (),
    nodes_to_quantize: Sequence[str] | None = None,
    range_overrides: dict[str, float] | None = None,
) -> QuantizeResult:
    """Quantize ``fp32_path`` (prepared by :func:`prepare_for_quantization`) to ``out_path``.

    With ``cache_path`` the ranges are read from there when it exists (and ``calib_inputs``
    is not run), else computed and saved there; ignored where ONNX Runtime has no cache.
    ``range_overrides``: symmetric ranges (max |x|) of named activations that replace the
    calibrated ones (a QAT fine-tune's own).
    """
    t0 = time.perf_counter()
    reader = BatchReader(calib_inputs, input_name, cfg.batch_size)
    cache: dict[str, str] = {}
    if cache_path is not None and CACHE_SUPPORTED:
        cache["calibration_cache_path"] = str(cache_path)
    with _quiet_ort(), atomic_output(Path(out_path)) as tmp:
        quantize_static(
            str(fp32_path),
            str(tmp),
            reader,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8 if recipe.activations_signed else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            reduce_range=recipe.reduce_range,
            calibrate_method=ort_calibration_method(cfg.method),
            nodes_to_exclude=[*with_float_inputs(fp32_path, nodes_to_exclude),
                              *float_parameter_nodes(fp32_path)],
            nodes_to_quantize=list(nodes_to_quantize) if nodes_to_quantize is not None else None,
            extra_options={**qdq_options(recipe), **ort_calibration_options(cfg),
                           **_overrides(range_overrides)},
            **cache,  # type: ignore[arg-type]
        )
    return QuantizeResult(
        path=Path(out_path),
        recipe=recipe,
        excluded=list(nodes_to_exclude),
        size_bytes=Path(out_path).stat().st_size,
        seconds=time.perf_counter() - t0,
    )
