from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hpc_core.config import DataConfig
from hpc_core.data import ResumableSampler, build_datasets, make_loader, steps_per_epoch


def test_digits_split_is_deterministic_and_disjoint() -> None:
    a_train, a_val, info = build_datasets(DataConfig())
    b_train, b_val, _ = build_datasets(DataConfig())
    assert info.num_train + info.num_val == 1797
    assert (info.num_classes, info.in_channels, info.image_size) == (10, 1, 8)
    assert torch.equal(a_val.x, b_val.x) and torch.equal(a_train.y, b_train.y)
    c_train, _, _ = build_datasets(DataConfig(split_seed=1))
    assert not torch.equal(a_train.y, c_train.y)
    assert float(a_train.x.min()) >= 0.0 and float(a_train.x.max()) <= 1.0


def test_digits_resize() -> None:
    train, _, info = build_datasets(DataConfig(image_size=32))
    assert info.image_size == 32 and tuple(train[0][0].shape) == (1, 32, 32)


def test_image_folder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog", "eel"):
        (tmp_path / cls).mkdir()
        for i in range(5):
            arr = rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.{'png' if i % 2 else 'jpg'}")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    train, val, info = build_datasets(
        DataConfig(source="image_folder", path=tmp_path, image_size=8, grayscale=False)
    )
    assert info.num_classes == 3 and info.in_channels == 3 and info.image_size == 8
    assert len(train) + len(val) == 15
    x, y = train[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and 0 <= int(y) < 3


def test_image_folder_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a folder"):
        build_datasets(DataConfig(source="image_folder", path=tmp_path / "nope"))
    (tmp_path / "only").mkdir()
    with pytest.raises(ValueError, match="at least 2 class sub-folders"):
        build_datasets(DataConfig(source="image_folder", path=tmp_path))


def test_npz_arrays(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 255, (40, 10, 10), dtype=np.uint8)
    y = np.arange(40) % 4
    np.savez(tmp_path / "d.npz", x=x, y=y)
    train, _, info = build_datasets(DataConfig(source="npz", path=tmp_path / "d.npz"))
    assert info.num_classes == 4 and info.in_channels == 1 and info.image_size == 10
    assert float(train.x.max()) <= 1.0


def test_npz_with_pickled_objects_is_refused(tmp_path: Path) -> None:
    # An object array can only be stored pickled; loading it must not unpickle.
    obj = np.empty(2, dtype=object)
    obj[0], obj[1] = {"a": 1}, [2]
    np.savez(tmp_path / "evil.npz", x=obj, y=np.array([0, 1]))
    with pytest.raises(ValueError, match="allow_pickle"):
        build_datasets(DataConfig(source="npz", path=tmp_path / "evil.npz"))
    np.savez(tmp_path / "nox.npz", y=np.array([0, 1]))
    with pytest.raises(ValueError, match=r"missing arrays \['x'\]"):
        build_datasets(DataConfig(source="npz", path=tmp_path / "nox.npz"))


def test_ddp_shards_cover_the_same_samples_as_one_process() -> None:
    train, _, _ = build_datasets(DataConfig())
    one = ResumableSampler(train, 1, 0, seed=3)
    ranks = [ResumableSampler(train, 2, r, seed=3) for r in range(2)]
    for s in (one, *ranks):
        s.set_epoch(4)
    single = list(one)
    per_rank = [list(s) for s in ranks]
    b = 16  # per-rank batch; one process takes 32
    for step in range(steps_per_epoch(len(train), 2 * b)):
        union = set(per_rank[0][step * b : (step + 1) * b]) | set(
            per_rank[1][step * b : (step + 1) * b]
        )
        assert union == set(single[step * 2 * b : (step + 1) * 2 * b])


def test_sampler_resumes_mid_epoch() -> None:
    train, _, _ = build_datasets(DataConfig())
    s = ResumableSampler(train, 1, 0, seed=0)
    s.set_epoch(2)
    full = list(s)
    s.set_epoch(2, start_index=100)
    assert list(s) == full[100:] and len(s) == len(full) - 100
    s.set_epoch(3)
    assert list(s) != full


def test_loader_does_not_touch_the_global_rng() -> None:
    train, _, _ = build_datasets(DataConfig())
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = make_loader(train, 32, DataConfig(), sampler=ResumableSampler(train, 1, 0, seed=0))
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


def test_batch_larger_than_data_is_an_error() -> None:
    with pytest.raises(ValueError, match="global_batch_size=5000 exceeds"):
        steps_per_epoch(1437, 5000)
