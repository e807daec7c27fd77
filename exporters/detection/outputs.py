"""The outputs of an exported detector: names, shapes and dtypes, in one place.

An exported detector (``exporters.detection.core`` + ``exporters.detection.tail``) ends in
non-maximum suppression inside the graph and gives fixed-size, padded outputs shaped like
those of TensorRT's ``EfficientNMS_TRT`` plugin, which TensorRT and DeepStream users expect:

- ``num_detections`` ``[N, 1]`` int32: how many rows of the others are detections;
- ``boxes`` ``[N, K, 4]`` float32: x1, y1, x2, y2 in input pixels;
- ``scores`` ``[N, K]`` float32, by decreasing score;
- ``classes`` ``[N, K]`` int32: the task's class ids (``0 .. classes-1``, no background).

``K`` is the detector's ``detections_per_img``. Rows from ``num_detections`` on are padding
(boxes and scores 0, classes -1): read only the first ``num_detections`` rows. The model
server and the gates read detections through :func:`unpack` here, torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INPUT_NAME = "input"
"""The image batch, float32 ``[N, 3, S, S]`` in [0, 1], at the model's ``image_size``."""
HEAD_NAME = "head"
"""The raw head of the quantized core: ``[N, A, C + 4]``, per anchor the ``C`` class logits
(background first) then the 4 box regressions. What INT8 quantizes and what the layer
sensitivity is measured on."""
NUM_DETECTIONS, BOXES, SCORES, CLASSES = "num_detections", "boxes", "scores", "classes"
OUTPUT_NAMES = (NUM_DETECTIONS, BOXES, SCORES, CLASSES)
"""The graph's outputs, in this order (``EfficientNMS_TRT``'s order)."""
OUTPUT_DTYPES = {NUM_DETECTIONS: np.int32, BOXES: np.float32, SCORES: np.float32,
                 CLASSES: np.int32}
PAD_CLASS = -1
"""``classes`` of a padding row."""
MODEL_LABEL_OFFSET = 1
"""What a PyTorch detector's labels add to the task's class ids (torchvision's background is
label 0): ``hpc_core.tasks.detection.sources.LABEL_OFFSET``, repeated here torch-free (a test
holds the two equal)."""
PACKED_COLUMNS = 6
"""A packed detection row: x1, y1, x2, y2, score, class (a float; -1 on padding)."""


def output_shapes(k: int) -> dict[str, tuple[str | int, ...]]:
    """Each output's shape for ``k`` detections per image (``N``: the batch)."""
    return {NUM_DETECTIONS: ("N", 1), BOXES: ("N", k, 4), SCORES: ("N", k), CLASSES: ("N", k)}


def pack(outputs: Sequence[np.ndarray]) -> np.ndarray:
    """The four outputs (in :data:`OUTPUT_NAMES` order) as one float32 ``[N, K, 6]`` array,
    padding rows with score 0 and class -1: one array per batch, as a classifier's logits, so
    batching and the hand-over between an export's halves treat both alike."""
    num, boxes, scores, classes = outputs
    n, k = scores.shape
    valid = np.arange(k)[None, :] < np.asarray(num).reshape(n, 1)
    packed = np.zeros((n, k, PACKED_COLUMNS), dtype=np.float32)
    packed[..., :4] = np.where(valid[..., None], boxes, 0.0)
    packed[..., 4] = np.where(valid, scores, 0.0)
    packed[..., 5] = np.where(valid, classes, PAD_CLASS)
    return packed


def pack_detections(detections: Sequence[dict[str, np.ndarray]], k: int,
                    label_offset: int = 0) -> np.ndarray:
    """Per-image ``{"boxes", "scores", "labels"}`` (a PyTorch detector's own output) packed
    as :func:`pack` does, labels shifted down by ``label_offset`` (torchvision's background)."""
    packed = np.zeros((len(detections), k, PACKED_COLUMNS), dtype=np.float32)
    packed[..., 5] = PAD_CLASS
    for i, d in enumerate(detections):
        m = min(k, len(d["scores"]))
        packed[i, :m, :4] = np.asarray(d["boxes"])[:m]
        packed[i, :m, 4] = np.asarray(d["scores"])[:m]
        packed[i, :m, 5] = np.asarray(d["labels"])[:m] - label_offset
    return packed


def unpack(packed: np.ndarray) -> list[dict[str, np.ndarray]]:
    """Per-image ``{"boxes" (n, 4), "scores" (n,), "labels" (n,) int64}`` of a packed batch,
    padding dropped; labels are the task's class ids."""
    out = []
    for rows in packed:
        keep = rows[:, 5] >= 0
        out.append({"boxes": rows[keep, :4], "scores": rows[keep, 4],
                    "labels": rows[keep, 5].astype(np.int64)})
    return out


TARGET_COLUMNS = 7
"""A packed ground-truth row: image index, class id, iscrowd, x1, y1, x2, y2."""


def pack_targets(targets: Sequence[dict[str, np.ndarray]], label_offset: int = 0
                 ) -> np.ndarray:
    """Per-image ``{"boxes", "labels"[, "iscrowd"]}`` as one float32 ``[objects, 7]`` array
    (:data:`TARGET_COLUMNS`), labels shifted down by ``label_offset``: a detector's held-out
    targets through the hand-over's single ``.npz`` (no pickle)."""
    rows = []
    for i, t in enumerate(targets):
        labels = np.asarray(t["labels"]).reshape(-1)
        boxes = np.asarray(t["boxes"], dtype=np.float32).reshape(-1, 4)
        crowd = np.asarray(t.get("iscrowd", np.zeros(len(labels)))).reshape(-1)
        block = np.zeros((len(labels), TARGET_COLUMNS), dtype=np.float32)
        block[:, 0], block[:, 1], block[:, 2], block[:, 3:] = i, labels - label_offset, crowd, boxes
        rows.append(block)
    return np.concatenate(rows) if rows else np.zeros((0, TARGET_COLUMNS), np.float32)


def unpack_targets(rows: np.ndarray, images: int) -> list[dict[str, np.ndarray]]:
    """:func:`pack_targets` undone, for ``images`` images (an image may hold no object)."""
    out = []
    for i in range(images):
        r = rows[rows[:, 0] == i]
        out.append({"boxes": r[:, 3:7], "labels": r[:, 1].astype(np.int64),
                    "iscrowd": r[:, 2].astype(np.int64)})
    return out


def as_scored(packed: np.ndarray, target_rows: np.ndarray
              ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """Packed detections and packed targets as the detection task's scorer
    (``hpc_core.tasks.score``) takes them: per-image dicts, labels as the model's data sets
    give them (the task's class ids shifted by its background offset)."""
    preds = [{**d, "labels": d["labels"] + MODEL_LABEL_OFFSET} for d in unpack(packed)]
    truth = [{**t, "labels": t["labels"] + MODEL_LABEL_OFFSET}
             for t in unpack_targets(target_rows, len(packed))]
    return preds, truth


def model_detections(outputs: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The four outputs of a batch as a PyTorch detector gives its detections: per image
    ``{"boxes", "scores", "labels"}``, labels with the background offset
    (:data:`MODEL_LABEL_OFFSET`): what the detection task's scorer and the device's health
    check take from either runtime."""
    return [{**d, "labels": d["labels"] + MODEL_LABEL_OFFSET} for d in unpack(pack(outputs))]
