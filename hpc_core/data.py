"""Data sets and loaders: sklearn's bundled digits, image folders and .npz arrays.

Nothing here downloads: digits ships inside scikit-learn. Every data set yields
``(x: float32 CHW in [0, 1], y: int64)``; the train/validation split is a seeded permutation
(``data.split_seed``), so every rank and every resume sees the same split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from hpc_core.config import DataConfig
from hpc_core.digits import digits_arrays

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class DataInfo:
    num_classes: int
    in_channels: int
    image_size: int
    num_train: int
    num_val: int


class TensorImageDataset(Dataset):
    """Images already in memory as one (N, C, H, W) float tensor."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.ndim != 4 or len(x) != len(y):
            raise ValueError(
                f"expected x (N,C,H,W) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        self.x, self.y = x.contiguous(), y.long().contiguous()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ImageFolderDataset(Dataset):
    """``root/<class>/<image>.png|jpg``; images are opened lazily with Pillow."""

    def __init__(self, root: Path, image_size: int | None, grayscale: bool) -> None:
        if not root.is_dir():
            raise ValueError(f"data.path {root} is not a folder of class sub-folders")
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        if len(self.classes) < 2:
            raise ValueError(
                f"data.path {root} needs at least 2 class sub-folders, found {self.classes}"
            )
        self.samples = [
            (f, label)
            for label, cls in enumerate(self.classes)
            for f in sorted((root / cls).iterdir())
            if f.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.samples:
            raise ValueError(
                f"data.path {root}: no {'/'.join(IMAGE_SUFFIXES)} files in class folders"
            )
        self.mode = "L" if grayscale else "RGB"
        self.image_size = image_size or self._probe_size()

    def _probe_size(self) -> int:
        from PIL import Image

        with Image.open(self.samples[0][0]) as im:
            w, h = im.size
        if w != h:
            raise ValueError(f"{self.samples[0][0]} is {w}x{h}: set data.image_size to resize")
        return w

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as im:
            im = im.convert(self.mode)
            if im.size != (self.image_size, self.image_size):
                im = im.resize((self.image_size, self.image_size), Image.BILINEAR)
            arr = np.asarray(im, dtype=np.float32) / 255.0
        x = (
            torch.from_numpy(arr).unsqueeze(0)
            if arr.ndim == 2
            else torch.from_numpy(arr).permute(2, 0, 1)
        )
        return x.contiguous(), torch.tensor(label, dtype=torch.long)


def _resize(x: torch.Tensor, size: int | None) -> torch.Tensor:
    if size is None or x.shape[-1] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def load_digits_tensors(image_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 1,797 8x8 digits as (N,1,H,W) floats in [0, 1] and int64 labels."""
    images, labels = digits_arrays()
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    return _resize(x, image_size), torch.from_numpy(labels.copy())


def load_npz_tensors(path: Path, image_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"data.path {path} does not exist")
    # allow_pickle=False: an .npz from elsewhere must never run code on load.
    with np.load(path, allow_pickle=False) as z:
        missing = {"x", "y"} - set(z.files)
        if missing:
            raise ValueError(
                f"{path}: missing arrays {sorted(missing)} (need x and y, has {z.files})"
            )
        x, y = z["x"], z["y"]
    return images_from_arrays(x, y, image_size, str(path))


def images_from_arrays(x: np.ndarray, y: np.ndarray, image_size: int | None, source: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Arrays x (N,H,W or N,C,H,W; uint8 0-255 or float 0-1) and y as the model's input:
    (N,C,H,W) floats in [0, 1] at ``image_size``, int64 labels."""
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(
            f"{source}: x must be (N,H,W) or (N,C,H,W) with N == len(y); got {x.shape}, {y.shape}"
        )
    xt = torch.from_numpy(x.astype(np.float32))
    if x.dtype == np.uint8:
        xt = xt / 255.0
    return _resize(xt, image_size), torch.from_numpy(y.astype(np.int64))


def held_out(ds: Dataset, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``limit`` samples of a split (all: None) as float32 images and int labels."""
    n = len(ds) if limit is None else min(limit, len(ds))  # type: ignore[arg-type]
    x, y = getattr(ds, "x", None), getattr(ds, "y", None)
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x[:n].numpy().astype(np.float32), y[:n].numpy()
    items = [ds[i] for i in range(n)]
    return (
        torch.stack([a for a, _ in items]).numpy().astype(np.float32),
        np.array([int(b) for _, b in items]),
    )


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * val_fraction))
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    """The train and validation splits, and what a model needs to know about them."""
    full: Dataset
    if cfg.source == "image_folder":
        assert cfg.path is not None
        full = ImageFolderDataset(cfg.path, cfg.image_size, cfg.grayscale)
        labels = [label for _, label in full.samples]
        x0, _ = full[0]
    else:
        if cfg.source == "digits":
            x, y = load_digits_tensors(cfg.image_size)
        else:
            assert cfg.path is not None
            x, y = load_npz_tensors(cfg.path, cfg.image_size)
        full = TensorImageDataset(x, y)
        labels = y.tolist()
        x0 = x[0]
    train_idx, val_idx = split_indices(len(labels), cfg.val_fraction, cfg.split_seed)
    info = DataInfo(
        num_classes=max(labels) + 1,
        in_channels=int(x0.shape[0]),
        image_size=int(x0.shape[-1]),
        num_train=len(train_idx),
        num_val=len(val_idx),
    )
    return _subset(full, train_idx), _subset(full, val_idx), info


def _subset(ds: Dataset, idx: list[int]) -> Dataset:
    # In-memory data is sliced so batches are gathered without a per-sample Python hop.
    if isinstance(ds, TensorImageDataset):
        t = torch.tensor(idx)
        return TensorImageDataset(ds.x[t], ds.y[t])
    return Subset(ds, idx)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through (exact resume).

    The permutation depends on ``seed + epoch`` only, not on the world size, so rank r of W
    sees ``perm[r::W]`` and the union of one step's per-rank batches is the same contiguous
    slice of ``perm`` that a single process would take: DDP and one process train on the
    same samples at every step.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start_index = 0

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        super().set_epoch(epoch)
        self.start_index = start_index

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start_index :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start_index)


def loader_kwargs(cfg: DataConfig) -> dict[str, object]:
    kw: dict[str, object] = {"num_workers": cfg.num_workers, "pin_memory": cfg.pin_memory}
    if cfg.num_workers > 0:
        kw["persistent_workers"] = cfg.persistent_workers
        if cfg.prefetch_factor is not None:
            kw["prefetch_factor"] = cfg.prefetch_factor
    return kw


def steps_per_epoch(num_train: int, global_batch_size: int) -> int:
    """Whole optimizer steps per epoch; the ragged tail is dropped so every step is full."""
    steps = num_train // global_batch_size
    if steps == 0:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} exceeds the {num_train} training "
            "samples: lower it"
        )
    return steps


def eval_shard(n: int, rank: int, world_size: int) -> list[int]:
    """This rank's share of the validation set: no padding, so no sample counts twice."""
    return list(range(rank, n, world_size))


def make_loader(
    ds: Dataset,
    batch_size: int,
    cfg: DataConfig,
    *,
    sampler: ResumableSampler | None = None,
    seed: int = 0,
    collate_fn: Callable[[list], object] | None = None,
) -> DataLoader:
    """Batches of ``ds`` in order (or ``sampler``'s); ``collate_fn`` is the task's (None:
    torch's default, stacked tensors)."""
    # An explicit generator keeps DataLoader from drawing its base seed from the global torch
    # RNG: creating an iterator would otherwise shift dropout masks and break exact resume.
    return DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=False,
        drop_last=False,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(seed),
        **loader_kwargs(cfg),  # type: ignore[arg-type]
    )
