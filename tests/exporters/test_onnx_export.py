from __future__ import annotations

import contextlib
import importlib
import pkgutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from exporters import onnx_export
from exporters.job import OnnxExportConfig
from exporters.onnx_export import (
    export_onnx,
    list_torchlib_ops_without_parsing,
    onnxscript_listing,
    opset_of,
)
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


# The exporter's torchlib functions listed without parsing their source: the same list as
# onnxscript's own, and the same exported file.


def _entries(listing: list) -> list[tuple]:
    return [(m.qualified_name, m.function, m.domain, m.name, m.is_complex) for m in listing]


def _bound_listings() -> dict[str, object]:
    """Each onnxscript ``_framework_apis`` module's ``get_torchlib_ops``."""
    apis = importlib.import_module("onnxscript._framework_apis")
    found = {}
    for info in pkgutil.iter_modules(apis.__path__):
        module = importlib.import_module(f"{apis.__name__}.{info.name}")
        if hasattr(module, "get_torchlib_ops"):
            found[module.__name__] = module.get_torchlib_ops
    return found


def test_the_listing_is_onnxscripts_own_entry_for_entry() -> None:
    assert list_torchlib_ops_without_parsing() is True
    original = onnxscript_listing()
    assert original is not None
    bound = _bound_listings()
    # Every module that bound onnxscript's listing (the one this torch release calls among
    # them) now calls this one.
    assert bound and all(f is not original for f in bound.values()), bound
    ours = next(iter(bound.values()))()
    theirs = original()
    assert len(ours) > 400
    assert _entries(ours) == _entries(theirs)
    # Listed afresh on each call, as onnxscript's is: a function registered since is listed.
    from onnxscript.function_libs.torch_lib import registration

    funcs = registration.default_registry["aten::relu"]
    extra = funcs.overloads[0]
    funcs.overloads.append(extra)
    try:
        again = next(iter(bound.values()))()
        assert _entries(again) == _entries(original()) and len(again) == len(ours) + 1
    finally:
        funcs.overloads.pop()


def test_an_export_is_byte_for_byte_the_one_onnxscripts_listing_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    cfg = OnnxExportConfig()
    assert list_torchlib_ops_without_parsing() is True
    ours = export_onnx(model, tmp_path / "ours.onnx", (1, 8, 8), cfg)
    original = onnxscript_listing()
    for name in _bound_listings():  # onnxscript's own listing back, for this export only
        monkeypatch.setattr(importlib.import_module(name), "get_torchlib_ops", original)
    theirs = export_onnx(model, tmp_path / "theirs.onnx", (1, 8, 8), cfg)
    assert ours.path.read_bytes() == theirs.path.read_bytes()


def test_an_unknown_onnxscript_layout_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_export, "_listing_installed", None)
    base = importlib.import_module("onnxscript._framework_apis.torch_2_5")
    monkeypatch.delattr(base, "_OnnxFunctionMeta")
    before = _bound_listings()
    assert list_torchlib_ops_without_parsing() is False
    assert _bound_listings() == before


class _MobileBlock(nn.Module):
    """MobileNetV3's activations, in place as torchvision builds them, and a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.hswish, self.relu6 = nn.Hardswish(inplace=True), nn.ReLU6(inplace=True)
        self.gate, self.relu = nn.Hardsigmoid(inplace=True), nn.ReLU(inplace=True)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu6(self.hswish(self.conv(x)))
        return self.head(self.relu(h * self.gate(h.mean((2, 3), keepdim=True))))


def _in_place(model: nn.Module) -> dict[str, bool]:
    return {n: m.inplace for n, m in model.named_modules() if hasattr(m, "inplace")}


def test_in_place_activations_export_the_same_graph_traced_out_of_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.export_time import graph_of

    torch.manual_seed(0)
    model = _MobileBlock().eval()
    example = torch.zeros(2, 1, 8, 8)
    with onnx_export.activations_out_of_place(model, example):
        assert _in_place(model) == {"hswish": False, "relu6": False, "gate": False,
                                    "relu": True}  # ReLU is traced as cheaply either way
    assert set(_in_place(model).values()) == {True}
    ours = export_onnx(model, tmp_path / "ours.onnx", (1, 8, 8))
    assert set(_in_place(model).values()) == {True}  # set back after the export
    ops = {n.op_type for n in onnx.load(str(ours.path)).graph.node}
    assert {"HardSwish", "HardSigmoid", "Clip", "Relu"} <= ops, ops
    with monkeypatch.context() as m:  # the baseline: traced with its in-place modules
        m.setattr(onnx_export, "activations_out_of_place",
                  lambda model, example: contextlib.nullcontext())
        theirs = export_onnx(model, tmp_path / "theirs.onnx", (1, 8, 8))
    assert graph_of(ours.path) == graph_of(theirs.path)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        want = model(x.clone()).numpy()
    np.testing.assert_allclose(OrtRunner(ours.path)(x.numpy()), want, rtol=1e-5, atol=1e-5)


def test_the_flags_are_set_back_when_the_export_fails() -> None:
    model = _MobileBlock().eval()
    with pytest.raises(RuntimeError, match="export failed"), \
            onnx_export.activations_out_of_place(model, torch.zeros(2, 1, 8, 8)):
        raise RuntimeError("export failed")
    assert set(_in_place(model).values()) == {True}


def test_a_model_in_train_mode_is_not_run_nor_changed() -> None:
    model = _MobileBlock().train()
    model.conv.register_forward_hook(lambda *_: pytest.fail("the model was run"))
    with onnx_export.activations_out_of_place(model, torch.zeros(2, 1, 8, 8)):
        assert set(_in_place(model).values()) == {True}


class _ReadsWhatItChanged(nn.Module):
    """Drops the activation's result and returns the tensor it changed in place: out of
    place, it would return that tensor unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Hardtanh(-0.5, 0.5, inplace=True)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        self.act(y)
        return y


def test_a_model_that_needs_its_in_place_side_effect_is_exported_as_it_is(
        tmp_path: Path) -> None:
    model = _ReadsWhatItChanged().eval()
    with onnx_export.activations_out_of_place(model, torch.zeros(2, 3)):
        assert model.act.inplace is True  # out of place its output differs: left alone
    out = export_onnx(model, tmp_path / "m.onnx", (3,), OnnxExportConfig(simplify="off"),
                      output_name="y")
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(OrtRunner(out.path)(x), np.clip(2 * x, -0.5, 0.5))
