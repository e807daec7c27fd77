"""How a data set is dealt out to simulated devices: the field's non-IID partitions.

The label partitions are NIID-Bench's (Li et al. 2022, "Federated learning on non-IID data
silos", ``partition_data`` of its code; Flower's baselines reproduce them):

  iid            a random permutation cut into equal shares ("homo")
  dirichlet:A    label skew: for every class, Dirichlet(A) proportions over the devices
                 (a device already holding N / devices samples takes no more), the class's
                 samples cut at those proportions; the whole draw is repeated until every
                 device holds at least ``MIN_SIZE`` samples ("noniid-labeldir"). Small A
                 concentrates each class on few devices; large A tends to iid.
  labels:K       K labels per device: device i holds class ``i mod C`` and K - 1 others drawn
                 at random; each class is cut into as many equal shares as devices hold it
                 ("noniid-#label"). K = C splits every class over every device.

Feature skew comes from the device cameras (:mod:`hpc_core.cameras`):

  cameras:LIST   device i sees through camera ``LIST[i mod len(LIST)]``; a camera is
                 ``plain`` (the data as it is) or distortions chained with ``/`` in the
                 order applied (``invert/noise``)

Parts combine with ``+``: at most one label partition (``iid`` when none is given) and one
camera mix, e.g. ``dirichlet:0.5+cameras:plain,invert,rotate``. The same spec, labels,
device count and seed give the same split.

Why here, beside ``data`` and ``cameras``: the camera part needs :mod:`hpc_core.cameras`
(torch), which ``hpc_core.aggregation`` may not import (torch-free by contract) and ``fleet``
may not either (it imports nothing of hpc_core); the label split itself is numpy only.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from hpc_core.cameras import KINDS, distort

LabelSkew = Literal["iid", "dirichlet", "labels"]
PLAIN = "plain"
"""The camera that leaves the data as it is."""
MIN_SIZE = 10
"""NIID-Bench's ``min_require_size``: every device holds at least this many samples under
``dirichlet``, or the whole draw is repeated."""
MAX_DRAWS = 1000
"""Dirichlet draws tried before a spec is refused as unsatisfiable."""
FORMS = ("iid", "dirichlet:ALPHA", "labels:K", "cameras:CAM,CAM,...")


class PartitionError(ValueError):
    """A partition spec that cannot be used; the message names the part and the fix."""


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed spec: one label partition and the cameras devices cycle through."""

    labels: LabelSkew = "iid"
    alpha: float | None = None
    """dirichlet: the concentration (> 0)."""
    k: int | None = None
    """labels: classes per device (>= 1)."""
    cameras: tuple[tuple[str, ...], ...] = ()
    """Per camera, its distortions in order (``()`` is ``plain``); empty: no camera part."""

    def __str__(self) -> str:
        head = {"iid": "iid", "dirichlet": f"dirichlet:{self.alpha:g}",
                "labels": f"labels:{self.k}"}[self.labels]
        if not self.cameras:
            return head
        cams = ",".join("/".join(c) if c else PLAIN for c in self.cameras)
        return f"{head}+cameras:{cams}"


@dataclass(frozen=True)
class Shard:
    """One device's part of the data set."""

    indices: np.ndarray
    """Indices into the data set, in the order the device holds them."""
    camera: tuple[str, ...] = ()
    """Its camera's distortions in order (``()``: plain)."""


def _fix(part: str) -> str:
    return (f"partition part {part!r}: use one of {', '.join(FORMS)}, joined with '+' "
            "(e.g. dirichlet:0.5+cameras:plain,invert)")


def _camera(item: str, part: str) -> tuple[str, ...]:
    if item == PLAIN:
        return ()
    kinds = tuple(item.split("/"))
    for kind in kinds:
        if kind not in KINDS:
            near = difflib.get_close_matches(kind, [*KINDS, PLAIN], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise PartitionError(
                f"{part!r}: unknown camera {kind!r}{hint}: a camera is {PLAIN} or "
                f"distortions of {', '.join(KINDS)} chained with '/'")
    return kinds


def _number(text: str, part: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise PartitionError(f"{part!r}: {text!r} is not {what}; {_fix(part)}") from None


def parse_spec(text: str) -> PartitionSpec:
    """``text`` as a :class:`PartitionSpec`; :class:`PartitionError` names what to change."""
    labels: LabelSkew | None = None
    alpha: float | None = None
    k: int | None = None
    cameras: tuple[tuple[str, ...], ...] | None = None
    if not text.strip():
        raise PartitionError(f"empty partition spec: use one of {', '.join(FORMS)}")
    for raw in text.split("+"):
        part = raw.strip()
        name, sep, arg = part.partition(":")
        if name in ("iid", "dirichlet", "labels"):
            if labels is not None:
                raise PartitionError(f"{text!r}: two label partitions ({labels} and {name}); "
                                     "give one, and combine it with cameras:... only")
            if name == "iid":
                if sep:
                    raise PartitionError(f"{part!r}: iid takes no argument; write 'iid'")
            elif name == "dirichlet":
                alpha = _number(arg, part, float)
                if not (np.isfinite(alpha) and alpha > 0):
                    raise PartitionError(f"{part!r}: alpha must be > 0 (0.5 is the field's "
                                         "usual label skew, 100 near iid)")
            else:
                k = int(_number(arg, part, int))
                if k < 1:
                    raise PartitionError(f"{part!r}: K labels per device, >= 1")
            labels = name
        elif name == "cameras":
            if cameras is not None:
                raise PartitionError(f"{text!r}: two camera parts; list every camera in one "
                                     "(cameras:plain,invert,rotate)")
            items = [c.strip() for c in arg.split(",")]
            if not arg.strip() or any(not c for c in items):
                raise PartitionError(f"{part!r}: list cameras separated by ',', each "
                                     f"{PLAIN} or of {', '.join(KINDS)} (chained with '/')")
            cameras = tuple(_camera(c, part) for c in items)
        else:
            raise PartitionError(_fix(part))
    return PartitionSpec(labels or "iid", alpha, k, cameras or ())


def split(spec: PartitionSpec | str, labels: np.ndarray, devices: int,
          seed: int = 0) -> list[Shard]:
    """Deal the samples whose labels are ``labels`` out to ``devices`` devices. Every sample
    goes to at most one device; to exactly one under ``iid`` and ``dirichlet``, and under
    ``labels:K`` when every class is held by some device (NIID-Bench leaves the classes no
    device drew unused: with fewer than C / K devices some must be)."""
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    labels = np.asarray(labels)
    if devices < 1:
        raise PartitionError(f"devices: {devices}; at least 1")
    if labels.ndim != 1 or len(labels) < devices:
        raise PartitionError(f"{len(labels)} samples for {devices} devices: give every "
                             "device at least one (fewer devices, or more data)")
    rng = np.random.default_rng(seed)
    if spec.labels == "iid":
        parts = np.array_split(rng.permutation(len(labels)), devices)
    elif spec.labels == "dirichlet":
        assert spec.alpha is not None
        parts = _dirichlet(labels, devices, spec.alpha, rng)
    else:
        assert spec.k is not None
        parts = _k_labels(labels, devices, spec.k, rng)
    cams = spec.cameras or ((),)
    return [Shard(np.asarray(p, dtype=np.int64), cams[i % len(cams)])
            for i, p in enumerate(parts)]


def min_size(samples: int, devices: int) -> int:
    """The least a device must hold under ``dirichlet``: NIID-Bench's 10, or half the even
    share where that is smaller (100 devices on 1,437 digits: 7), so that the resampling
    can end."""
    return max(1, min(MIN_SIZE, samples // devices // 2))


def _dirichlet(labels: np.ndarray, devices: int, alpha: float,
               rng: np.random.Generator) -> list[np.ndarray]:
    n = len(labels)
    need = min_size(n, devices)
    classes = np.unique(labels)
    for _ in range(MAX_DRAWS):
        batches: list[list[int]] = [[] for _ in range(devices)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(devices, alpha))
            # A device that already holds its even share takes no more of this class.
            p = p * np.array([len(b) < n / devices for b in batches])
            if p.sum() <= 0:  # every open device drew ~0 (tiny alpha): the open ones share
                p = np.array([len(b) < n / devices for b in batches], dtype=np.float64)
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for b, part in zip(batches, np.split(idx, cuts), strict=True):
                b.extend(part.tolist())
        if min(len(b) for b in batches) >= need:
            out = [np.array(b, dtype=np.int64) for b in batches]
            for b in out:
                rng.shuffle(b)
            return out
    raise PartitionError(f"dirichlet:{alpha:g}: no draw in {MAX_DRAWS} gave each of "
                         f"{devices} devices {need} samples; use a larger alpha or fewer "
                         "devices")


def _k_labels(labels: np.ndarray, devices: int, k: int,
              rng: np.random.Generator) -> list[np.ndarray]:
    classes = np.unique(labels)
    c = len(classes)
    if k > c:
        raise PartitionError(f"labels:{k}: the data has {c} classes; K at most {c}")
    parts: list[list[np.ndarray]] = [[] for _ in range(devices)]
    if k == c:  # NIID-Bench: every class cut over every device
        for cls in classes:
            idx = np.flatnonzero(labels == cls)
            rng.shuffle(idx)
            for part, piece in zip(parts, np.array_split(idx, devices), strict=True):
                part.append(piece)
    else:
        held = []
        for i in range(devices):
            own = [i % c]
            while len(own) < k:
                pick = int(rng.integers(c))
                if pick not in own:
                    own.append(pick)
            held.append(own)
        for j, cls in enumerate(classes):
            holders = [i for i in range(devices) if j in held[i]]
            if not holders:
                continue
            idx = np.flatnonzero(labels == cls)
            rng.shuffle(idx)
            for i, piece in zip(holders, np.array_split(idx, len(holders)), strict=True):
                parts[i].append(piece)
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]


def histograms(shards: Sequence[Shard], labels: np.ndarray) -> np.ndarray:
    """Devices x classes sample counts (classes as ``np.unique(labels)`` orders them)."""
    classes = np.unique(labels)
    return np.stack([(labels[s.indices][:, None] == classes[None, :]).sum(0) for s in shards])


def device_data(x: torch.Tensor, y: torch.Tensor, shard: Shard,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One device's samples (``x`` in [0, 1]) as its camera sees them, and their labels; the
    camera's noise is seeded with ``seed``."""
    idx = torch.from_numpy(shard.indices)
    return distort(x[idx], shard.camera, seed=seed), y[idx]
