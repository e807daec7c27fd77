"""Ecosystem models by name: classifiers, detectors, timm; local weights pinned by sha256;
no download ever."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from hpc_core.models import build_model, model_spec_errors
from hpc_core.vision.no_download import DownloadRefused, downloads_refused
from hpc_core.vision.weights import WeightsError, load_pretrained
from registry.model_config import ModelConfig, WeightsFile


def build(name: str, *, num_classes: int = 5, in_channels: int = 1, image_size: int = 32,
          **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, num_classes=num_classes, in_channels=in_channels,
                       image_size=image_size, **kw)


@pytest.mark.parametrize("name", ["torchvision/resnet18", "torchvision/mobilenet_v3_small",
                                  "timm/mobilenetv3_small_050"])
def test_classifier_by_name_honours_sizes(name: str) -> None:
    model = build(name)
    out = model(torch.rand(2, 1, 32, 32))
    assert out.shape == (2, 5)
    out.sum().backward()


def test_vits_are_built_for_the_image_size() -> None:
    with torch.device("meta"):  # shapes only: vit_b_16 is 86 M parameters
        tv_vit = build("torchvision/vit_b_16", image_size=32, in_channels=3)
    assert tuple(tv_vit.encoder.pos_embedding.shape) == (1, (32 // 16) ** 2 + 1, 768)
    timm_vit = build("timm/vit_tiny_patch16_224", image_size=32, in_channels=1)
    assert timm_vit(torch.rand(1, 1, 32, 32)).shape == (1, 5)


@pytest.mark.parametrize("name", ["torchvision/ssdlite320_mobilenet_v3_large",
                                  "torchvision/fcos_resnet18_fpn"])
def test_detector_trains_and_detects(name: str) -> None:
    model = build(name, num_classes=4, in_channels=3, image_size=64)
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    targets = [{"boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[10.0, 10.0, 50.0, 60.0], [0.0, 0.0, 8.0, 8.0]]),
                "labels": torch.tensor([3, 2])}]
    model.train()
    losses = model(images, targets)
    loss = sum(losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.eval()
    with torch.no_grad():
        out = model(images[:1])
    assert set(out[0]) == {"boxes", "scores", "labels"}
    assert out[0]["boxes"].shape[1:] == (4,)
    assert all(0 < int(label) < 4 for label in out[0]["labels"])


def test_ssdlite_batchnorm_momentum_is_a_setting() -> None:
    def momenta(model: torch.nn.Module) -> set[float | None]:
        return {m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)}

    kw = {"num_classes": 3, "in_channels": 3, "image_size": 64}
    assert momenta(build("torchvision/ssdlite320_mobilenet_v3_large", **kw)) == {0.03}
    model = build("torchvision/ssdlite320_mobilenet_v3_large", bn_momentum=0.1, **kw)
    assert momenta(model) == {0.1}
    # one training batch moves every running mean a tenth of the way to the batch's mean
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    before = bn.running_mean.clone()
    seen: list[torch.Tensor] = []
    bn.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach()))
    model.train()
    box = {"boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0]]), "labels": torch.tensor([1])}
    model([torch.rand(3, 64, 64), torch.rand(3, 64, 64)], [box, box])
    torch.testing.assert_close(bn.running_mean,
                               0.9 * before + 0.1 * seen[0].mean(dim=(0, 2, 3)))
    with pytest.raises(ValueError, match=r"model.kwargs.bn_momentum=0: .*\(0, 1\]"):
        build("torchvision/ssdlite320_mobilenet_v3_large", bn_momentum=0, **kw)


def test_retinanet_and_grey_detector_input() -> None:
    model = build("torchvision/retinanet_resnet18_fpn", num_classes=3, in_channels=1,
                  image_size=64).eval()
    with torch.no_grad():
        out = model([torch.rand(1, 64, 64)])
    assert set(out[0]) == {"boxes", "scores", "labels"}


def test_unknown_names_listed_with_close_ones() -> None:
    with pytest.raises(ValueError,
                       match=r"model.name 'torchvision/resnet81'.*close names: .*resnet18"):
        build("torchvision/resnet81")
    with pytest.raises(ValueError,
                       match=r"timm has no model 'mobilenetv3_smal_100'.*mobilenetv3_small_100"):
        build("timm/mobilenetv3_smal_100")
    assert model_spec_errors("torchvision/resnet81", {})[0].startswith("  model.name:")
    with pytest.raises(ValidationError, match="torchvision/NAME"):
        ModelConfig(name="keras/resnet18")
    ModelConfig(name="my.models:build")  # a custom factory is not an ecosystem name


def test_a_builder_that_would_download_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model.kwargs.weights.*model.weights"):
        build("torchvision/resnet18", weights="IMAGENET1K_V1")
    with pytest.raises(ValueError, match=r"pretrained=True would download"):
        build("timm/mobilenetv3_small_050", pretrained=True)
    # Whatever reaches a downloader while a model is built is refused, naming the model and
    # the fix; afterwards the functions are torch's own again.
    original = torch.hub.load_state_dict_from_url
    with downloads_refused("torchvision/resnet18"), \
            pytest.raises(DownloadRefused, match=r"'torchvision/resnet18'.*model.weights"):
        torch.hub.load_state_dict_from_url("https://example.invalid/w.pth")
    with downloads_refused("timm/x"):
        import timm.models._builder as builder
        with pytest.raises(DownloadRefused, match="timm/x"):
            builder.load_state_dict_from_url("https://example.invalid/w.pth")
    assert torch.hub.load_state_dict_from_url is original


def test_timm_hub_download_refused_in_a_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timm build that asks for pretrained weights through its own path (pretrained_cfg
    overlay with a file URL) reaches the guarded downloader, not the network."""
    import timm

    with downloads_refused("timm/resnet10t"), pytest.raises(DownloadRefused, match="resnet10t"):
        timm.create_model("resnet10t", pretrained=True, num_classes=3,
                          pretrained_cfg_overlay={"url": "https://example.invalid/r.pth",
                                                  "hf_hub_id": None, "file": None})


def _pinned(path: Path) -> WeightsFile:
    return WeightsFile(path=str(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def test_weights_from_a_local_file_with_head_resized(tmp_path: Path) -> None:
    src = build("torchvision/resnet18", num_classes=10, in_channels=3)
    path = tmp_path / "r18.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    dst = build("torchvision/resnet18", num_classes=4, in_channels=1)
    report = load_pretrained(dst, _pinned(path))
    assert report.head_reset == ["fc.weight", "fc.bias"]
    assert report.adapted == ["conv1.weight"]
    assert torch.equal(dst.layer4[1].conv2.weight, src.layer4[1].conv2.weight)
    assert torch.allclose(dst.conv1.weight, src.conv1.weight.sum(1, keepdim=True))
    assert dst.fc.weight.shape == (4, 512)


def test_pth_checkpoint_read_weights_only(tmp_path: Path) -> None:
    src = build("timm/mobilenetv3_small_050", in_channels=1)
    path = tmp_path / "m.pth"
    torch.save({"state_dict": src.state_dict()}, path)
    dst = build("timm/mobilenetv3_small_050", in_channels=1)
    report = load_pretrained(dst, _pinned(path))
    assert not report.missing and not report.head_reset
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v)
    evil = tmp_path / "evil.pth"
    torch.save({"state_dict": src.state_dict(), "x": object()}, evil)
    with pytest.raises(WeightsError, match="weights-only"):
        load_pretrained(dst, _pinned(evil))


def test_wrong_hash_and_wrong_backbone_refused(tmp_path: Path) -> None:
    src = build("torchvision/resnet18")
    path = tmp_path / "r18.safetensors"
    save_file(src.state_dict(), str(path))
    good = _pinned(path)
    wrong = WeightsFile(path=str(path), sha256="0" * 64)
    with pytest.raises(WeightsError, match=f"has sha256 {good.sha256}, the config pins {'0' * 64}"):
        load_pretrained(build("torchvision/resnet18"), wrong)
    with pytest.raises(WeightsError, match=r"not this model's backbone|shares no tensor|lacks"):
        load_pretrained(build("torchvision/resnet34"), good)
    with pytest.raises(WeightsError, match=r"shares no tensor|lacks"):
        load_pretrained(build("torchvision/mobilenet_v3_small"), good)
