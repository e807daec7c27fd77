"""COCO detection folders: ``annotations.json`` (or ``annotations/instances_*.json``) beside
an ``images/`` folder, read and checked at the boundary.

The JSON is validated with pydantic: the fields detection needs are typed and required, and
the extra keys COCO files carry (``info``, ``licenses``, ``segmentation``, ``area``, a labelling
tool's own keys) are allowed, as COCO allows them. Then every image and annotation is checked
against the others and against the image files; all problems are reported together, each with
the file, the image or annotation id, and the fix (:class:`~.boxes.DetectionDataError`).

``iscrowd`` is kept as COCO keeps it: crowd regions stay in the record for the metric and are
left out of training targets by the ``Dataset``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpc_core.tasks.detection.boxes import (
    DetectionDataError,
    OnOutside,
    check_box,
    coco_to_xyxy,
    xyxy_to_coco,
)
from hpc_core.tasks.detection.records import DetectionSet, ImageRecord
from registry.atomic import write_json_atomic
from registry.validation import format_errors

ANNOTATIONS_FILE = "annotations.json"
IMAGES_DIR = "images"


class _CocoObject(BaseModel):
    # COCO files carry more than detection reads (flickr_url, license, segmentation, a tool's
    # own attributes): taken and ignored, never refused.
    model_config = ConfigDict(extra="allow")


class CocoImage(_CocoObject):
    id: int
    file_name: str = Field(min_length=1)
    width: int = Field(gt=0)
    height: int = Field(gt=0)


class CocoCategory(_CocoObject):
    id: int
    name: str = Field(min_length=1)


class CocoAnnotation(_CocoObject):
    id: int
    image_id: int
    category_id: int
    bbox: list[float] = Field(min_length=4, max_length=4)
    """``[x, y, width, height]`` in pixels, from the image's top-left corner."""
    iscrowd: Literal[0, 1] = 0


class CocoFile(_CocoObject):
    images: list[CocoImage]
    annotations: list[CocoAnnotation]
    categories: list[CocoCategory] = Field(min_length=1)


def find_annotations(folder: Path) -> Path:
    """``folder/annotations.json``, else the one ``folder/annotations/instances_*.json``."""
    direct = folder / ANNOTATIONS_FILE
    if direct.is_file():
        return direct
    found = sorted((folder / "annotations").glob("instances_*.json"))
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(p.name for p in found)
        raise DetectionDataError(str(folder), [
            f"several instances files ({names}): pass annotations= to choose one"])
    raise DetectionDataError(str(folder), [
        f"no {ANNOTATIONS_FILE} and no annotations/instances_*.json: put the COCO JSON there "
        "or pass annotations="])


def _read_coco_file(path: Path) -> CocoFile:
    raw = path.read_bytes()
    if not raw.strip():
        raise DetectionDataError(str(path), [
            "the file is empty: expected a COCO JSON object with images, annotations and "
            "categories"])
    try:
        tree = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DetectionDataError(str(path), [f"not JSON ({e}): fix the file"]) from None
    try:
        return CocoFile.model_validate(tree)
    except ValidationError as e:
        raise DetectionDataError(str(path), [
            line.strip() for line in format_errors(e, CocoFile)]) from None


def _duplicates(kind: str, ids: list[int]) -> list[str]:
    return [f"{kind} id {i} appears {n} times: ids must be unique"
            for i, n in sorted(Counter(ids).items()) if n > 1]


def _check_image_file(path: Path, image: CocoImage) -> str | None:
    from PIL import Image, UnidentifiedImageError

    where = f"image id {image.id}"
    if not path.is_file():
        return (f"{where}: file {image.file_name} is missing under {path.parent}: copy it "
                "there, or remove the image and its annotations")
    try:
        with Image.open(path) as im:
            size = im.size
    except (UnidentifiedImageError, OSError) as e:
        return f"{where}: file {image.file_name} is not a readable image ({e}): replace it"
    if size != (image.width, image.height):
        return (f"{where}: file {image.file_name} is {size[0]}x{size[1]}, the JSON says "
                f"{image.width}x{image.height}: fix width/height")
    return None


def load_coco(
    folder: Path,
    *,
    annotations: Path | None = None,
    images_dir: Path | None = None,
    on_outside: OnOutside = "refuse",
) -> DetectionSet:
    """A COCO detection folder, checked: raises :class:`DetectionDataError` listing every
    problem. ``images_dir`` defaults to ``folder/images`` (or ``folder`` when it has none);
    a box reaching past its image by more than a pixel is refused unless ``on_outside="clip"``.
    Classes are the categories in id order."""
    folder = Path(folder)
    path = Path(annotations) if annotations is not None else find_annotations(folder)
    if images_dir is None:
        images_dir = folder / IMAGES_DIR if (folder / IMAGES_DIR).is_dir() else folder
    coco = _read_coco_file(path)
    problems = (_duplicates("image", [i.id for i in coco.images])
                + _duplicates("annotation", [a.id for a in coco.annotations])
                + _duplicates("category", [c.id for c in coco.categories]))
    categories = sorted(coco.categories, key=lambda c: c.id)
    index = {c.id: k for k, c in enumerate(categories)}
    images = {i.id: i for i in coco.images}
    for image in coco.images:
        problem = _check_image_file(images_dir / image.file_name, image)
        if problem:
            problems.append(problem)
    objects: dict[int, list[tuple[np.ndarray, int, bool]]] = {i.id: [] for i in coco.images}
    for a in coco.annotations:
        where = f"annotation id {a.id} (image id {a.image_id})"
        image = images.get(a.image_id)
        if image is None:
            problems.append(f"{where}: image id {a.image_id} is not in images: add the image "
                            "or remove the annotation")
            continue
        if a.category_id not in index:
            known = ", ".join(str(c.id) for c in categories)
            problems.append(f"{where}: category_id {a.category_id} is not in categories "
                            f"(known: {known}): add it to categories or fix the annotation")
            continue
        box, problem = check_box(coco_to_xyxy(np.array(a.bbox))[0], image.width, image.height,
                                 on_outside)
        if problem:
            problems.append(f"{where}: bbox {a.bbox} (xywh): {problem}")
            continue
        assert box is not None
        objects[a.image_id].append((box, index[a.category_id], bool(a.iscrowd)))
    if problems:
        raise DetectionDataError(str(path), problems)
    records = [_record(i, objects[i.id]) for i in coco.images]
    return DetectionSet(images_dir, [c.name for c in categories], records,
                        [c.id for c in categories])


def _record(image: CocoImage, objects: list[tuple[np.ndarray, int, bool]]) -> ImageRecord:
    boxes = (np.stack([o[0] for o in objects]) if objects
             else np.zeros((0, 4), dtype=np.float32))
    return ImageRecord(
        image_id=image.id, file_name=image.file_name, width=image.width, height=image.height,
        boxes=boxes.astype(np.float32),
        labels=np.array([o[1] for o in objects], dtype=np.int64),
        iscrowd=np.array([o[2] for o in objects], dtype=bool))


def coco_dict(dataset: DetectionSet) -> dict:
    """``dataset`` as a COCO detection JSON object (what :func:`write_coco` writes and the
    metric's ground truth is built like)."""
    anns = []
    for r in dataset.records:
        for box, label, crowd in zip(xyxy_to_coco(r.boxes), r.labels, r.iscrowd, strict=True):
            w, h = float(box[2]), float(box[3])
            # ids from 1: pycocotools takes an annotation id of 0 for "unmatched"
            anns.append({"id": len(anns) + 1, "image_id": r.image_id,
                         "category_id": dataset.category_ids[int(label)],
                         "bbox": [round(float(v), 3) for v in box], "area": round(w * h, 3),
                         "iscrowd": int(crowd)})
    return {
        "images": [{"id": r.image_id, "file_name": r.file_name, "width": r.width,
                    "height": r.height} for r in dataset.records],
        "annotations": anns,
        "categories": [{"id": cid, "name": name} for cid, name
                       in zip(dataset.category_ids, dataset.class_names, strict=True)],
    }


def write_coco(folder: Path, dataset: DetectionSet) -> Path:
    """Write ``folder/annotations.json`` for ``dataset`` (atomically, 0600); the images are
    expected under ``folder/images`` already."""
    path = Path(folder) / ANNOTATIONS_FILE
    write_json_atomic(path, coco_dict(dataset))
    return path
