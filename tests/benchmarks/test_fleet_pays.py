"""What benchmarks/fleet_pays.py's figures rest on: the release is the product's fedavg of
the devices' weights with their BatchNorm statistics averaged by samples, each device's
splits are its own and disjoint, and a device's training keeps its best epoch on
validation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from benchmarks import fleet_pays
from benchmarks.fleet_pays import (
    Device,
    TooFew,
    accuracy,
    devices,
    fedavg,
    fit,
    make_model,
)
from hpc_core.data import load_digits_tensors
from hpc_core.partitions import histograms, split


def _moved(model: torch.nn.Module, by: float) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(by)
        for b in out.buffers():
            if b.dtype.is_floating_point:
                b.add_(by)
    return out


def test_the_release_is_the_sample_weighted_mean_of_weights_and_statistics() -> None:
    torch.manual_seed(0)
    base = make_model()
    a, b = _moved(base, 1.0), _moved(base, -2.0)
    release = fedavg(base, [a, b], [30, 10])  # weights 0.75, 0.25: +0.75 - 0.5 = +0.25
    for name, v in release.state_dict().items():
        if v.dtype.is_floating_point:
            assert torch.allclose(v, base.state_dict()[name] + 0.25, atol=1e-5), name
        else:  # num_batches_tracked: the release's own
            assert torch.equal(v, base.state_dict()[name]), name


def test_each_device_holds_its_own_disjoint_splits_with_the_partitions_label_skew() -> None:
    x, y = load_digits_tensors(16)
    spec = "dirichlet:0.5+cameras:invert,invert/blur"
    devs = devices(x, y, spec, 4, samples=20, test=30, seed=1)
    assert [(len(d.train[1]), len(d.val[1])) for d in devs] == [(20, 10)] * 4
    assert all(10 <= len(d.test[1]) <= 30 for d in devs)
    # The splits are the shard's samples in order: no sample in two of them.
    shards = split(spec, y.numpy(), 4, seed=1)
    for d, s in zip(devs, shards, strict=True):
        held = torch.cat([d.train[1], d.val[1], d.test[1]])
        assert torch.equal(held, y[torch.from_numpy(s.indices[:len(held)])])
    # Label skew: the devices' class histograms differ (dirichlet:0.5 over 4 devices).
    h = histograms(shards, y.numpy())
    assert (h.max(1) / h.sum(1)).max() > 0.2
    with pytest.raises(TooFew, match="not enough for 400"):
        devices(x, y, spec, 4, samples=400, test=30, seed=1)


def test_a_devices_training_keeps_its_best_epoch_on_validation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    x, y = load_digits_tensors(16)
    model = make_model()
    rng = np.random.default_rng(0).permutation(len(y))
    part = [torch.from_numpy(rng[i:i + 60]) for i in (0, 60, 120)]
    dev = Device(*[(x[p], y[p]) for p in part])
    seen: list[float] = []  # every validation score fit computes: the start, then each epoch

    def scored(m: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
        acc = accuracy(m, data)
        if data is dev.val:
            seen.append(acc)
        return acc

    monkeypatch.setattr(fleet_pays, "accuracy", scored)
    trained = fit(model, dev, n_epochs=8, lr=0.005, seed=3)
    assert len(seen) == 9 and len(set(seen)) > 1, seen  # training moved it
    assert accuracy(trained, dev.val) == max(seen), seen
    # Zero epochs: the start itself, untouched.
    same = fit(model, dev, n_epochs=0, lr=0.005, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(),
                                                  model.state_dict().values(), strict=True))


@pytest.mark.parametrize(("argv", "why"), [
    (["--rounds", "0"], "at least 1"),
    (["--test", "3"], "at least 10"),
    (["--upstream-share", "1.5"], "a share between 0 and 1"),
    (["--samples", "10,x"], "comma-separated whole numbers"),
    (["--lr", "0"], "--lr 0.0: above 0"),
    (["--cameras", "invert,fisheye"], "unknown camera 'fisheye'"),
])
def test_bad_flags_are_refused_naming_the_flag_before_anything_trains(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        fleet_pays.parse(argv)
    assert e.value.code == 2
    assert why in capsys.readouterr().err
