from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from exporters.job import OnnxExportConfig
from exporters.onnx_export import export_onnx
from exporters.ort_runner import OrtRunner
from hpc_core.checkpoint import load_model
from hpc_core.config import TrainConfig, config_from_dict
from hpc_core.data import build_datasets, held_out
from hpc_core.models import available_models, build_model, model_spec_errors
from hpc_core.trainer import Trainer


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("mlp", {"hidden": [32, 16]}),
        ("small_cnn", {"width": 8}),
        ("small_cnn", {"width": 8, "norm": "group"}),
        ("resnet", {"width": 8, "norm": "batch"}),
        ("resnet", {"width": 8, "norm": "group", "blocks": [2, 1, 1]}),
        ("mobilenet_v2", {"width_mult": 0.25}),
        ("vit", {"dim": 32, "depth": 1}),
        ("vit", {"patch": 4, "mlp_ratio": 4.0}),
    ],
)
def test_registry_models_forward_and_backward(name: str, kwargs: dict) -> None:
    model = build_model(name, num_classes=10, in_channels=3, image_size=16, **kwargs)
    out = model(torch.randn(4, 3, 16, 16))
    assert out.shape == (4, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_group_norm_really_replaces_batch_norm() -> None:
    m = build_model("resnet", num_classes=10, in_channels=1, image_size=8, norm="group")
    kinds = {type(x) for x in m.modules()}
    assert nn.GroupNorm in kinds and nn.BatchNorm2d not in kinds


def test_width_multiplier_scales_mobilenet() -> None:
    def count(w: float) -> int:
        m = build_model("mobilenet_v2", num_classes=10, in_channels=1, image_size=8, width_mult=w)
        return sum(p.numel() for p in m.parameters())

    assert count(0.25) < count(0.5) < count(1.0)


def test_user_factory_by_import_path() -> None:
    m = build_model("tests.hpc_core.user_model:tiny", num_classes=3, in_channels=1, image_size=4)
    assert m(torch.zeros(2, 1, 4, 4)).shape == (2, 3)


def test_unknown_model_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'vgg'.*small_cnn"):
        build_model("vgg", num_classes=3, in_channels=1, image_size=4)
    with pytest.raises(ValueError, match="cannot import module"):
        build_model("no_such_pkg.mod:f", num_classes=3, in_channels=1, image_size=4)
    with pytest.raises(ValueError, match="bad arguments"):
        build_model("small_cnn", num_classes=3, in_channels=1, image_size=4, depth=3)
    assert set(available_models()) >= {"mlp", "small_cnn", "resnet", "mobilenet_v2", "vit"}


@pytest.mark.parametrize(("size", "patch", "tokens"), [(8, 2, 16), (16, 2, 64), (32, 4, 64),
                                                       (28, 2, 196)])
def test_vit_default_patch_follows_the_image_size(size: int, patch: int, tokens: int) -> None:
    m = build_model("vit", num_classes=10, in_channels=1, image_size=size)
    assert m.patch_embed.stride == (patch, patch)
    assert m.pos_embed.shape == (1, tokens, 64)
    assert m(torch.rand(3, 1, size, size)).shape == (3, 10)


def test_vit_attention_runs_through_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dropout_p: list[float] = []

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        dropout_p.append(kwargs.get("dropout_p", 0.0))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    m = build_model("vit", num_classes=10, in_channels=1, image_size=8, depth=2, dropout=0.1)
    m(torch.rand(4, 1, 8, 8)).sum().backward()
    assert dropout_p == [0.1, 0.1]  # once per block; attention dropout while training
    assert m.blocks[0].attn.qkv.weight.grad is not None
    m.eval()
    m(torch.rand(4, 1, 8, 8))
    assert dropout_p[2:] == [0.0, 0.0]


def test_vit_refuses_kwargs_it_cannot_build_with_the_field_named() -> None:
    with pytest.raises(ValueError, match=r"model\.kwargs\.patch=3 does not divide "
                                         r"image_size=8: use one of \[1, 2, 4, 8\]"):
        build_model("vit", num_classes=10, in_channels=1, image_size=8, patch=3)
    with pytest.raises(ValueError, match=r"model\.kwargs\.dim=60 .* model\.kwargs\.heads=8"):
        build_model("vit", num_classes=10, in_channels=1, image_size=8, dim=60, heads=8)
    with pytest.raises(ValueError, match=r"model\.kwargs\.depth must be >= 1"):
        build_model("vit", num_classes=10, in_channels=1, image_size=8, depth=0)
    assert model_spec_errors("vit", {"width": 8}) == [
        "  model.kwargs.width: vit takes no argument 'width' "
        "(it takes: depth, dim, dropout, heads, mlp_ratio, patch)"
    ]


@pytest.fixture(scope="module")
def digits_vit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainConfig, float]:
    """The default vit trained on digits at their native 8 px (16 tokens of 2x2 pixels).

    A transformer has no convolutional prior, so it needs more epochs than small_cnn: 12 at
    lr 5e-3 reach ~0.94 (seeds 0-2: 0.93-0.94); ~10 s on one core."""
    cfg = config_from_dict({
        "run": {"name": "vit-digits", "output_dir": str(tmp_path_factory.mktemp("vit")),
                "seed": 0},
        "data": {"source": "digits"},
        "model": {"name": "vit"},
        "optimizer": {"name": "adamw", "lr": 0.005, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 20, "decay": "cosine"},
        "training": {"global_batch_size": 64, "epochs": 12, "device": "cpu"},
        "checkpoint": {"best_metric": None},
        "logging": {"progress": "off", "log_every_steps": 50},
        "faults": {"handle_signals": False},
    })
    result = Trainer(cfg).train()
    assert result.checkpoint_dir is not None
    return result.checkpoint_dir, cfg, result.metrics["eval/acc"]


def test_vit_trains_on_digits_at_8px(digits_vit: tuple[Path, TrainConfig, float]) -> None:
    _, _, val_acc = digits_vit
    assert val_acc > 0.9


def _onnx_matches_torch(model: nn.Module, x: np.ndarray, path: Path,
                        cfg: OnnxExportConfig | None = None) -> onnx.ModelProto:
    export_onnx(model, path, x.shape[1:], cfg)
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    runner = OrtRunner(path, threads=1)
    for batch in (x[:1], x):  # the batch axis stays symbolic
        got = runner(batch)
        assert np.abs(got - want[: len(batch)]).max() < 1e-3
    return onnx.load(str(path))


def test_trained_vit_exports_to_onnx_with_torchs_logits(
    digits_vit: tuple[Path, TrainConfig, float], tmp_path: Path
) -> None:
    checkpoint, cfg, _ = digits_vit
    model = load_model(checkpoint)[0]
    x, _ = held_out(build_datasets(cfg.data)[1], 64)
    proto = _onnx_matches_torch(model, x, tmp_path / "vit.onnx")
    ops = [n.op_type for n in proto.graph.node]
    # Attention is decomposed into standard ops (opset < 23 has no Attention op): one Softmax
    # per block between two MatMuls, nothing from a custom domain a runtime might lack.
    assert ops.count("Softmax") == len(model.blocks)
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}


@pytest.mark.parametrize("cfg", [OnnxExportConfig(),
                                 OnnxExportConfig(exporter="torchscript", opset=17)],
                         ids=["dynamo", "torchscript"])
def test_vit_exports_at_32px(cfg: OnnxExportConfig, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("vit", num_classes=10, in_channels=3, image_size=32)
    x = np.random.default_rng(0).random((4, 3, 32, 32), dtype=np.float32)
    _onnx_matches_torch(model, x, tmp_path / "vit.onnx", cfg)
