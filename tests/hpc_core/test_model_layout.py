"""The torch-free tensor table of every registered model equals torch's ``state_dict()``
over a grid of specs, refuses what its factory refuses, and checks a manifest with the same
messages as the torch check (tests/hpc_core/test_model_spec.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpc_core.model_layout import LAYOUTS, check_layout, expected_tensors
from hpc_core.model_spec import build_module, torch_dtype_name
from hpc_core.models import available_models
from registry.errors import SpecMismatchError
from registry.model_config import ModelConfig
from tests.support.manifests import manifest_for, model_state, parse

SIZES = ({"num_classes": 10, "in_channels": 1, "image_size": 8},
         {"num_classes": 3, "in_channels": 3, "image_size": 32})
KWARGS: dict[str, list[dict[str, Any]]] = {
    "mlp": [{}, {"hidden": []}, {"hidden": [5]}, {"hidden": [64, 32, 7], "dropout": 0.1}],
    "small_cnn": [{}, {"width": 8, "norm": "group"}, {"width": 5, "norm": "none"},
                  {"width": 12, "norm": "group", "dropout": 0.0}, {"width": 6, "pool": "flatten"},
                  {"width": 4, "norm": "none", "pool": "avg"}],
    "resnet": [{}, {"width": 8, "blocks": [2, 1]}, {"width": 4, "blocks": [0, 2, 1, 1],
                                                    "norm": "group"},
               {"width": 6, "blocks": [1, 3], "norm": "none"}],
    "mobilenet_v2": [{}, {"width_mult": 0.25}, {"width_mult": 1}, {"width_mult": 1.3,
                                                                    "dropout": 0.0}],
    "vit": [{}, {"patch": 2, "dim": 24, "depth": 1, "heads": 3},
            {"dim": 32, "depth": 2, "heads": 8, "mlp_ratio": 1.5, "dropout": 0.1},
            {"patch": 8, "mlp_ratio": 4}],
}


def torch_layout(spec: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    module = build_module(spec, meta=True, allow_custom=False)
    return {k: (torch_dtype_name(v.dtype), tuple(v.shape)) for k, v in module.state_dict().items()}


def test_every_registered_model_has_a_layout() -> None:
    assert sorted(LAYOUTS) == available_models() == sorted(KWARGS)


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_layout_equals_torchs_state_dict(name: str) -> None:
    for sizes in SIZES:
        for kwargs in KWARGS[name]:
            if name == "vit" and sizes["image_size"] % kwargs.get("patch", 1):
                continue
            spec = ModelConfig(name=name, kwargs=kwargs, **sizes)
            assert expected_tensors(spec) == torch_layout(spec), (sizes, kwargs)


@pytest.mark.parametrize("image_size", [4, 9, 30])
def test_a_flattening_small_cnn_sizes_its_head_as_torch_pools(image_size: int) -> None:
    # Two 2x2 max pools floor each side: 30 -> 15 -> 7, 9 -> 4 -> 2.
    spec = ModelConfig(name="small_cnn", kwargs={"width": 3, "pool": "flatten"}, num_classes=5,
                       in_channels=2, image_size=image_size)
    layout = expected_tensors(spec)
    assert layout == torch_layout(spec)
    assert layout["head.2.weight"][1] == (5, 12 * (image_size // 4) ** 2)


def test_a_flattening_small_cnn_needs_an_image_of_four_pixels() -> None:
    spec = ModelConfig(name="small_cnn", kwargs={"pool": "flatten"}, num_classes=10,
                       in_channels=1, image_size=3)
    with pytest.raises(SpecMismatchError, match="image_size >= 4"):
        expected_tensors(spec)
    with pytest.raises(SpecMismatchError, match="image_size >= 4"):  # torch's build: the same
        torch_layout(spec)


REFUSED = [
    ("mlp", {"hidden": [64, 2.5]}), ("mlp", {"hidden": [64], "dropout": 1.5}),
    ("mlp", {"hidden": 64}), ("mlp", {"width": 3}),
    ("small_cnn", {"norm": "layer"}), ("small_cnn", {"dropout": -0.1}),
    ("small_cnn", {"pool": "max"}),
    ("resnet", {"blocks": [1, 1.5]}), ("resnet", {"norm": "instance"}),
    ("mobilenet_v2", {"width_mult": 0}), ("mobilenet_v2", {"dropout": 2}),
    ("vit", {"patch": 3}), ("vit", {"dim": 30, "heads": 4}), ("vit", {"depth": 0}),
    ("vit", {"dropout": 1.1}), ("no_such_model", {}),
]


@pytest.mark.parametrize(("name", "kwargs"), REFUSED)
def test_a_spec_the_factory_refuses_is_refused(name: str, kwargs: dict[str, Any]) -> None:
    spec = ModelConfig(name=name, kwargs=kwargs, num_classes=10, in_channels=1, image_size=8)
    with pytest.raises(SpecMismatchError, match="does not build"):
        expected_tensors(spec)
    with pytest.raises((SpecMismatchError, RuntimeError)):  # torch: the same spec fails
        torch_layout(spec)


# The torch check's cases (test_model_spec.py), through the torch-free one: same messages.


def test_layout_check_names_the_mismatching_tensor(tmp_path: Path) -> None:
    m, doc = manifest_for(tmp_path / "m.safetensors", model_state())
    check_layout(m)
    doc["model"]["kwargs"] = {"hidden": [64, 32]}
    with pytest.raises(SpecMismatchError, match=r"3\.weight.*F32\[64, 64\].*needs F32\[32, 64\]"):
        check_layout(parse(doc))
    doc["model"]["kwargs"] = {"hidden": [64]}
    with pytest.raises(SpecMismatchError, match="unexpected tensor"):
        check_layout(parse(doc))
    doc["model"] = {**doc["model"], "name": "os:system", "kwargs": {}}
    with pytest.raises(SpecMismatchError, match="custom models"):
        check_layout(parse(doc))


def test_layout_check_catches_a_dtype_change(tmp_path: Path) -> None:
    state = {k: (v.half() if k == "1.weight" else v) for k, v in model_state().items()}
    m, _ = manifest_for(tmp_path / "m.safetensors", state)
    with pytest.raises(SpecMismatchError, match=r"1\.weight: manifest has F16"):
        check_layout(m)


def test_model_layout_never_imports_torch(subprocess_env: dict[str, str]) -> None:
    code = ("import sys\nimport hpc_core.model_layout\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env, timeout=60, check=True)
    assert "torch imported: False" in done.stdout
