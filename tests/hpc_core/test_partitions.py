"""The non-IID partitions: what each spec does to the devices' label histograms, that every
sample is dealt once, that a seed fixes the split, and that bad specs are refused with the
fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpc_core.cameras import distort
from hpc_core.partitions import (
    PartitionError,
    PartitionSpec,
    device_data,
    histograms,
    min_size,
    parse_spec,
    split,
)

# 10 classes of 200 samples each, in class order (a split that ignores the shuffle shows).
LABELS = np.repeat(np.arange(10), 200)


def _all_indices(shards: list) -> np.ndarray:
    return np.sort(np.concatenate([s.indices for s in shards]))


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.5", "labels:2", "labels:10",
                                  "dirichlet:0.5+cameras:plain,invert"])
@pytest.mark.parametrize("devices", [1, 3, 10, 37])
def test_every_sample_is_dealt_exactly_once(spec: str, devices: int) -> None:
    shards = split(spec, LABELS, devices, seed=1)
    assert len(shards) == devices
    # labels:2 on fewer than 5 devices leaves classes nobody drew: tested below
    if spec != "labels:2" or devices >= 10:
        np.testing.assert_array_equal(_all_indices(shards), np.arange(len(LABELS)))


def test_labels_k_with_too_few_devices_uses_each_sample_at_most_once() -> None:
    shards = split("labels:2", LABELS, 3, seed=0)
    used = _all_indices(shards)
    assert len(np.unique(used)) == len(used)
    held = {int(c) for h in histograms(shards, LABELS) for c in np.flatnonzero(h)}
    # Exactly the samples of the classes some device holds.
    assert len(used) == 200 * len(held) and len(held) <= 6


def test_iid_histograms_are_near_uniform() -> None:
    h = histograms(split("iid", LABELS, 10, seed=3), LABELS)
    assert h.sum(1).tolist() == [200] * 10
    # 200 draws a device from 10 equal classes: a class's count is ~Binomial(200, 0.1),
    # sd 4.2; 20 is ~5 sd.
    assert np.abs(h - 20).max() <= 20 and (h > 0).all()


def _top_share(h: np.ndarray) -> float:
    """The mean share of a device's samples in its most frequent class."""
    return float((h.max(1) / h.sum(1)).mean())


def test_dirichlet_concentrates_as_alpha_falls() -> None:
    shares = {a: np.mean([_top_share(histograms(split(f"dirichlet:{a}", LABELS, 10, seed=s),
                                                LABELS)) for s in range(5)])
              for a in (100.0, 0.5, 0.05)}
    assert shares[100.0] < 0.2  # near iid: ~0.1-0.15
    assert shares[0.5] > shares[100.0] + 0.15
    assert shares[0.05] > shares[0.5] + 0.15 and shares[0.05] > 0.7
    held = (histograms(split("dirichlet:0.05", LABELS, 10, seed=0), LABELS) > 0).sum(1)
    assert held.mean() < 4  # most devices see few classes


def test_dirichlet_resamples_until_every_device_holds_the_minimum() -> None:
    for seed in range(5):
        sizes = [len(s.indices) for s in split("dirichlet:0.1", LABELS, 30, seed=seed)]
        assert min(sizes) >= min_size(len(LABELS), 30) == 10
    assert min_size(1437, 100) == 7  # the minimum shrinks where 10 each cannot be had


def test_dirichlet_refuses_what_no_draw_can_satisfy() -> None:
    with pytest.raises(PartitionError, match="larger alpha or fewer devices"):
        # one class: each draw hands (nearly) all of it to one device
        split("dirichlet:0.001", np.zeros(100, dtype=np.int64), 5, seed=0)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_labels_k_gives_each_device_exactly_k_labels(k: int) -> None:
    shards = split(f"labels:{k}", LABELS, 10, seed=2)
    h = histograms(shards, LABELS)
    assert ((h > 0).sum(1) == k).all()
    assert [int(np.argmax(h[i] > 0) if k == 1 else h[i, i % 10] > 0) for i in range(10)] == (
        list(range(10)) if k == 1 else [1] * 10)  # device i holds class i mod C
    # each class cut into equal shares over the devices that hold it
    for c in range(10):
        counts = h[:, c][h[:, c] > 0]
        assert counts.max() - counts.min() <= 1


def test_labels_c_splits_every_class_over_every_device() -> None:
    h = histograms(split("labels:10", LABELS, 8, seed=0), LABELS)
    assert (h >= 25).all() and (h <= 25).all()


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.5", "labels:3",
                                  "labels:2+cameras:invert,rotate/blur"])
def test_the_same_seed_gives_the_same_split_another_seed_another(spec: str) -> None:
    a, b, c = (split(spec, LABELS, 10, seed=s) for s in (7, 7, 8))
    assert all(np.array_equal(x.indices, y.indices) and x.camera == y.camera
               for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x.indices, y.indices) for x, y in zip(a, c, strict=True))


def test_cameras_cycle_over_devices_and_combine_with_a_label_partition() -> None:
    spec = parse_spec("dirichlet:0.5+cameras:plain,invert,rotate/noise")
    assert spec == PartitionSpec("dirichlet", 0.5, None, ((), ("invert",), ("rotate", "noise")))
    assert str(spec) == "dirichlet:0.5+cameras:plain,invert,rotate/noise"
    shards = split(spec, LABELS, 7, seed=0)
    assert [s.camera for s in shards] == [(), ("invert",), ("rotate", "noise")] * 2 + [()]
    # cameras alone: an iid split
    alone = split("cameras:blur", LABELS, 4, seed=0)
    iid = split("iid", LABELS, 4, seed=0)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(alone, iid, strict=True))
    assert all(s.camera == ("blur",) for s in alone)


def test_device_data_is_the_shard_through_its_camera() -> None:
    x = torch.rand(40, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.arange(40) % 4
    shard = split("iid+cameras:invert/rotate", y.numpy(), 2, seed=0)[1]
    xd, yd = device_data(x, y, shard, seed=5)
    idx = torch.from_numpy(shard.indices)
    assert torch.equal(yd, y[idx])
    assert torch.equal(xd, distort(x[idx], ["invert", "rotate"]))
    plain = split("iid", y.numpy(), 2, seed=0)[0]
    assert torch.equal(device_data(x, y, plain)[0], x[torch.from_numpy(plain.indices)])


@pytest.mark.parametrize(("spec", "fix"), [
    ("", "empty partition spec"),
    ("dirichlet", "not a number"),
    ("dirichlet:abc", "'abc' is not a number"),
    ("dirichlet:0", "alpha must be > 0"),
    ("dirichlet:-1", "alpha must be > 0"),
    ("dirichlet:nan", "alpha must be > 0"),
    ("labels:0", "K labels per device, >= 1"),
    ("labels:1.5", "'1.5' is not an integer"),
    ("iid:3", "iid takes no argument"),
    ("iid+dirichlet:0.5", "two label partitions"),
    ("cameras:invert+cameras:rotate", "two camera parts"),
    ("cameras:", "list cameras separated by ','"),
    ("cameras:invert,,rotate", "list cameras separated by ','"),
    ("cameras:inverted,rotated", "unknown camera 'inverted' \\(did you mean 'invert'\\?\\)"),
    ("cameras:invert/sepia", "unknown camera 'sepia'"),
    ("dirchlet:0.5", "use one of iid, dirichlet:ALPHA, labels:K, cameras:CAM"),
    ("dirichlet:0.5 cameras:invert", "not a number"),
])
def test_bad_specs_are_refused_with_the_fix(spec: str, fix: str) -> None:
    with pytest.raises(PartitionError, match=fix):
        parse_spec(spec)


def test_bad_splits_are_refused_with_the_fix() -> None:
    with pytest.raises(PartitionError, match="the data has 10 classes; K at most 10"):
        split("labels:11", LABELS, 10)
    with pytest.raises(PartitionError, match="at least 1"):
        split("iid", LABELS, 0)
    with pytest.raises(PartitionError, match="fewer devices, or more data"):
        split("iid", LABELS[:5], 6)
